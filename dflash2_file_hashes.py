"""Whole-file sha256 of a pack's weights, remembered by each file's identity, so the launch
checks hash weight data once: a start hashes every weights file it has not hashed before (with
a progress bar) and remembers each one that matched its pin; a later start hashes again only
a file whose identity changed (its device, inode, size, or its modification or status-change
time, which no user call can set back) or whose pin did.

One JSON file in the user's cache folder (as platformdirs.user_cache_dir puts it), with the
sha256 of its own content: a file that is unreadable, edited or corrupt is set aside, said in
one log line, and every weights file is hashed again.
"""

import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Optional

SCHEMA = 1
FILE_NAME = "weight-hashes.json"
KEEP_ENTRIES = 64  # the newest files remembered (a 27B pack has a few; old packs' go first)


def user_cache_folder() -> Path:
    """The platform's user cache folder for dflash2 (as platformdirs.user_cache_dir puts it)."""
    if sys.platform == "darwin":
        base = Path.home() / "Library" / "Caches"
    else:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = Path(xdg) if os.path.isabs(xdg) else Path.home() / ".cache"
    return base / "dflash2"


def canonical(value) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def content_sha256(data: dict) -> str:
    """What a cache file's own "sha256" field holds: the sha256 of its other fields, canonical."""
    return hashlib.sha256(canonical({name: value for name, value in data.items() if name != "sha256"})).hexdigest()


def identity(status: os.stat_result) -> list:
    """What changes whenever a file's bytes can have: device, inode, size, and the modification
    and status-change times in ns (of the file a link resolves to: a Hugging Face snapshot's
    blob)."""
    return [status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns, status.st_ctime_ns]


class RememberedHashes:
    """The remembered whole-file hashes (one cache file); `problem` says why none were read."""

    def __init__(self, path: Optional[Path] = None):
        self.path = path or user_cache_folder() / FILE_NAME
        self.files, self.problem = {}, None
        self.reused, self.hashed = [], []  # this start's weights files: remembered, hashed now
        if not self.path.is_file():
            return
        try:
            data = json.loads(self.path.read_text())
            if not isinstance(data, dict) or set(data) != {"schema", "files", "sha256"}:
                raise ValueError("its fields differ")
            if data["sha256"] != content_sha256(data):
                raise ValueError("edited or corrupt: its content sha256 differs")
            if data["schema"] != SCHEMA or not isinstance(data["files"], dict) or not all(
                    isinstance(entry, dict) and set(entry) == {"identity", "sha256"} for entry in data["files"].values()):
                raise ValueError("another schema")
        except (OSError, ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
            self.problem = f"{self.path} was set aside ({error}): every weights file is hashed again"
            return
        self.files = data["files"]

    def matches(self, path: Path, sha256: str) -> bool:
        """Whether `path` was hashed to `sha256` by an earlier start and has not changed since."""
        entry = self.files.get(str(path.resolve()))
        if entry is None or entry["sha256"] != sha256 or entry["identity"] != identity(path.stat()):
            return False
        self.reused.append(path)
        return True

    def remember(self, path: Path, sha256: str, status: os.stat_result) -> None:
        """`path` hashed to `sha256` now (a pin it matched), `status` its stat from before the
        hash: a file changed while it was hashed no longer matches it, and is hashed again."""
        name = str(path.resolve())
        self.files.pop(name, None)  # re-inserted last: the newest are kept
        self.files[name] = {"identity": identity(status), "sha256": sha256}
        self.hashed.append(path)

    def save(self) -> Optional[str]:
        """Writes the file atomically where a hash was remembered now; the error's text if it failed."""
        if not self.hashed:
            return None
        files = dict(list(self.files.items())[-KEEP_ENTRIES:])
        data = {"schema": SCHEMA, "files": files}
        data["sha256"] = content_sha256(data)
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            with tempfile.NamedTemporaryFile("w", dir=self.path.parent, suffix=".tmp", delete=False) as file:
                json.dump(data, file, indent=1)
            os.replace(file.name, self.path)
        except OSError as error:
            return f"{self.path}: {error}"
        return None
