"""Caches the verdicts of the speculative server's start-up checks, so a second start skips them.

On an H100 at the 27B shape the checks after the weights load took 466 s (kernel self-tests,
plain decode's arms, the sampled draws, the drafter's dtype, the round costs:
evidence/starts-cuda.md, at 23e968f). Their verdicts
depend only on what this file's key holds: the backend and device, the driver and CUDA (or
macOS) version, the mlx*/nvidia-* packages, Python, the sha256 of every pack module, the pack's
pins (or, unpinned, its configs and weights headers) and the drafter options. One JSON file per
key, in the user's cache folder, with the sha256 of its own content. A start whose key has a
valid file takes each cached verdict instead of measuring it; the exact verify self-check runs
at every start all the same. Any other start checks everything and says why in one log line:
--recheck, nothing cached for the key (with what the newest cached start differed in), or a file
that is unreadable, edited or corrupt.
"""

import dataclasses
import hashlib
import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

from dflash2_file_hashes import canonical, content_sha256, user_cache_folder
from dflash2_pack import PINS_FILE, safetensors_header_sha256

logger = logging.getLogger("dflash2.server")

SCHEMA = 1
KEEP_FILES = 8  # the newest cache files kept (one per key: pack, module edits, package versions)
MODULES = Path(__file__).absolute().parent  # where the pack's modules load from

# The start-up checks, in the order they run, and what each does.
CHECKS = {
    "kernel self-tests": "each kernel against MLX's own calls at the pack's shapes (a GPU's first start "
                         "builds every kernel)",
    "plain decode path": "plain decode's arms, checked against stock and timed",
    "verify path": "verify's layers compiled or built at every round, checked against decode and timed",
    "verify self-check": "exact verify rounds against decode steps on the pack's weights (at every start)",
    "sampled verify draws": "a verify block's sampled draws in one call against decode's per row",
    "drafter activations": "the drafter's activation dtypes, timed",
    "round costs": "each block's round, timed (the round policy's table)",
}
# What of mx.device_info() names the device (not its free memory, nor which of a host's GPUs).
DEVICE_FIELDS = ("device_name", "architecture", "compute_capability_major", "compute_capability_minor")
# Rough durations where no cached start has timed them: a first start's on an H100 at the 27B
# shape (evidence/starts-cuda.md, at 23e968f), every kernel compiled as it went.
ESTIMATES_S = {"cuda": {"kernel self-tests": 177, "plain decode path": 38, "verify path": 5, "verify self-check": 1,
                        "sampled verify draws": 76, "drafter activations": 77, "round costs": 58}}


def cache_folder() -> Path:
    return user_cache_folder() / "verdicts"


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_key(pack_dir: Path, target_dir: Path, drafter_dir: Optional[Path], options: dict) -> dict:
    """The key's part that reads files only: the pack modules, the pack and the drafter options."""
    pins = pack_dir / PINS_FILE
    if pins.is_file():
        pack = {PINS_FILE: _sha256(pins.read_bytes())}
    else:  # a source layout: what the loaders read of the model but its weight data
        pack = {}
        for folder in (target_dir, drafter_dir):
            for path in sorted(folder.glob("*.json")) if folder else ():
                pack[path.relative_to(pack_dir).as_posix()] = _sha256(path.read_bytes())
            for path in sorted(folder.glob("*.safetensors")) if folder else ():
                pack[path.relative_to(pack_dir).as_posix()] = safetensors_header_sha256(path)
    return {"modules": modules_key(), "pack": pack, "options": options}


def modules_key() -> dict:
    """The runtime's modules (dflash2_*.py, serve*.py) by name: the sha256 of each."""
    modules = sorted(MODULES.glob("dflash2_*.py")) + sorted(MODULES.glob("serve*.py"))
    return {path.name: _sha256(path.read_bytes()) for path in modules}


def machine_key() -> dict:
    """The key's part that needs MLX: backend, device, driver, system and package versions.
    Call it once dflash2_runtime is imported (it sets what MLX reads when the GPU starts)."""
    import mlx.core as mx

    import dflash2_kernel_cache
    import dflash2_kernel_folder
    import dflash2_kernels

    system = {"platform": platform.platform(), "python": platform.python_version()}
    if sys.platform == "darwin":
        system["macos"] = platform.mac_ver()[0]
    try:
        system["nvidia driver"] = Path("/proc/driver/nvidia/version").read_text().splitlines()[0]
    except (OSError, IndexError):
        pass
    return {"backend": dflash2_kernels.backend_name(),
            "device": {name: str(value) for name, value in mx.device_info().items() if name in DEVICE_FIELDS},
            "system": system, "packages": dflash2_kernel_folder.mlx_and_cuda_packages(),
            "kernel binaries": dflash2_kernel_cache.binaries()}


def _numbered(name: str) -> str:
    return f"start-up check {list(CHECKS).index(name) + 1} of {len(CHECKS)}: {name}"


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def read_cache_file(path: Path, key: Optional[dict]) -> dict:
    """The verdicts in `path` ({check: {"at", "seconds", "value"}}); ValueError says what is
    wrong with the file. key None: any key (the newest other file, read for its key and timings)."""
    try:
        data = json.loads(path.read_text())
    except OSError as error:
        raise ValueError(f"{path.name} cannot be read ({error.strerror})") from None
    except ValueError as error:  # also bytes that are not UTF-8
        raise ValueError(f"{path.name} is not valid JSON ({error})") from None
    if not isinstance(data, dict) or set(data) != {"schema", "key", "verdicts", "sha256"}:
        raise ValueError(f"{path.name} is not a verdict file (its fields differ)")
    if data["sha256"] != content_sha256(data):
        raise ValueError(f"{path.name} was edited or is corrupt (its content sha256 differs)")
    if data["schema"] != SCHEMA:
        raise ValueError(f"{path.name} has schema {data['schema']!r}, this runtime reads {SCHEMA}")
    if key is not None and data["key"] != key:
        raise ValueError(f"{path.name} holds another key than its name says")
    verdicts = data["verdicts"]
    well_formed = isinstance(verdicts, dict) and all(
        name in CHECKS and isinstance(entry, dict) and set(entry) == {"at", "seconds", "value"}
        and isinstance(entry["at"], str) and isinstance(entry["seconds"], (int, float))
        for name, entry in verdicts.items())
    if not well_formed or not isinstance(data["key"], dict):
        raise ValueError(f"{path.name} does not match the verdict file's schema")
    return {"key": data["key"], "verdicts": verdicts}


def key_differences(old: dict, new: dict) -> str:
    """What differs between two keys, e.g. 'modules (dflash2_requests.py), packages (mlx)'."""
    differences = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            parts = sorted(part for part in set(a) | set(b) if a.get(part) != b.get(part))
            differences.append(f"{name} ({', '.join(parts[:4])}{', ...' if len(parts) > 4 else ''})")
        else:
            differences.append(name)
    return ", ".join(differences)


@dataclasses.dataclass
class VerdictCache:
    """The start-up checks' verdicts for one key: those read from the cache file, those measured
    now. With pack None (tools, tests) nothing is read or written: every check runs."""

    pack: Optional[dict] = None  # pack_key(); None: no cache
    recheck: bool = False  # --recheck: check everything, then cache it
    key: Optional[dict] = None  # pack and machine_key(), once open() ran
    path: Optional[Path] = None
    full_check_because: Optional[str] = None  # None: the cached verdicts serve
    cached: dict = dataclasses.field(default_factory=dict)  # check -> {"at", "seconds", "value"} read from the file
    used: dict = dataclasses.field(default_factory=dict)  # check -> when the cached verdict it took was measured
    measured: dict = dataclasses.field(default_factory=dict)  # check -> {"at", "seconds", "value"} measured now
    estimates: dict = dataclasses.field(default_factory=dict)  # check -> seconds the last cached start took

    def open(self) -> None:
        """Computes the key and reads its cache file; logs what this start checks and why."""
        if self.pack is None:
            self.full_check_because = "no verdict cache"
            return
        self.key = json.loads(canonical({**machine_key(), **self.pack}))  # as a file gives it back
        self.path = cache_folder() / f"{_sha256(canonical(self.key))[:32]}.json"
        try:
            if not self.path.is_file():
                raise ValueError("nothing cached for this key yet" + self._newest_other_start())
            cached = read_cache_file(self.path, self.key)["verdicts"]
        except ValueError as error:
            self.full_check_because = str(error)
        else:
            self.estimates = {name: entry["seconds"] for name, entry in cached.items()}
            if self.recheck:
                self.full_check_because = "--recheck"
            else:
                self.cached = cached
        if self.full_check_because:
            logger.info("start-up checks: all of them: %s (their verdicts are cached in %s)",
                        self.full_check_because, self.path.parent)
        else:
            logger.info("start-up checks: the verdicts cached in %s serve; the verify self-check runs at "
                        "every start (--recheck checks everything)", self.path)

    def _newest_other_start(self) -> str:
        """What the newest other cache file's key differs in, and its timings as estimates."""
        others = sorted(self.path.parent.glob("*.json"), key=lambda path: path.stat().st_mtime, reverse=True)
        for other in others:
            try:
                data = read_cache_file(other, None)
            except ValueError:
                continue
            self.estimates = {name: entry["seconds"] for name, entry in data["verdicts"].items()}
            return f" (the newest cached start differed in: {key_differences(data['key'], self.key)})"
        return ""

    def check(self, name: str, measure: Callable, restore: Optional[Callable] = None,
              encode: Callable = dataclasses.asdict):
        """The check's verdict: restore(cached value) where the file holds one, else measure();
        restore None: measured at every start (the verify self-check). Logs one line either way."""
        number = _numbered(name)
        entry = self.cached.get(name)
        if restore is not None and entry is not None and entry["value"] is not None:
            try:
                value = restore(entry["value"])
            except (KeyError, TypeError, ValueError) as error:  # a file this runtime's schema did not foresee
                logger.info("%s: the cached verdict does not restore (%r): checking", number, error)
            else:
                self.used[name] = entry["at"]
                logger.info("%s: from the cache (measured %s)", number, entry["at"])
                return value
        logger.info("%s: %s (%s)", number, CHECKS[name], self._estimate(name))
        started = time.perf_counter()
        value = measure()
        self.measured[name] = {"at": _now(), "seconds": round(time.perf_counter() - started, 2),
                               "value": None if restore is None else encode(value)}
        return value

    def skip(self, name: str, why: str) -> None:
        """Logs that a check does not run at this start, and why."""
        logger.info("%s: not run: %s", _numbered(name), why)

    def _estimate(self, name: str) -> str:
        if name in self.estimates:
            return f"about {self.estimates[name]:.0f} s, as the last cached start took"
        guess = ESTIMATES_S.get(self.key["backend"] if self.key else None, {}).get(name)
        return f"about {guess} s on an H100 at the 27B shape" if guess else "no estimate on this backend yet"

    def measured_seconds(self) -> dict:
        """check -> seconds, of the checks this start ran."""
        return {name: entry["seconds"] for name, entry in self.measured.items()}

    def source(self, name: str) -> str:
        """How this start got a check's verdict, for the log."""
        return f"from the cache, measured {self.used[name]}" if name in self.used else "measured"

    def save(self) -> None:
        """Writes the verdicts measured now (beside the cached ones still valid) to the key's file,
        atomically; keeps the newest KEEP_FILES files. Nothing to write when no verdict was measured."""
        if self.path is None or not any(entry["value"] is not None for entry in self.measured.values()):
            return
        data = {"schema": SCHEMA, "key": self.key, "verdicts": {**self.cached, **self.measured}}
        data["sha256"] = content_sha256(data)
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.NamedTemporaryFile("w", dir=folder, suffix=".tmp", delete=False) as file:
                json.dump(data, file, indent=1, sort_keys=True)
            os.replace(file.name, self.path)
            for old in sorted(folder.glob("*.json"), key=lambda path: path.stat().st_mtime)[:-KEEP_FILES]:
                old.unlink()
        except OSError as error:
            logger.warning("the start-up verdicts could not be cached in %s: %s", folder, error)
            return
        logger.info("start-up checks: verdicts cached in %s", self.path)

    def discard(self) -> None:
        """Removes the key's file after a failed check on cached verdicts: the next start checks all."""
        if self.used and self.path is not None:
            self.path.unlink(missing_ok=True)
            logger.info("start-up checks: a check failed on cached verdicts: the next start checks everything")

    def to_json(self) -> dict:
        """For /health: why this start checked everything (or null), which verdicts came from the
        cache and when they were measured, and the seconds of those measured now."""
        return {"full_check_because": self.full_check_because, "from_cache": dict(self.used),
                "measured_s": self.measured_seconds()}
