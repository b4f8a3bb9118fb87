"""What MLX's CUDA kernel folder holds: whole entries or cut ones, and the NVIDIA setup its
binaries are for. No MLX here: the servers read this before MLX starts.

MLX loads a module from its PTX cache (MLX_PTX_CACHE_DIR, else <tmp>/mlx/<version>/ptx) under the
name it looks for without checking it (jit_module.cpp: read_cached_ptx, then cuModuleLoadDataEx,
which fails the op), and writes its own entries in place. A binary is SASS for one GPU
architecture, and MLX names its own modules by their ops, not their text: a folder serves one
MLX version and one NVIDIA setup, and an entry a crash cut must go before MLX reads it.
"""

import hashlib
import importlib.metadata
import json
import os
import re
import struct
from pathlib import Path
from typing import Optional


def nvidia_setup(driver_folder: Path = Path("/proc/driver/nvidia")) -> Optional[str]:
    """The GPU models and driver (from /proc/driver/nvidia, without starting CUDA) and the
    mlx and nvidia-* wheels' versions, as text; None where no NVIDIA driver runs, or where the
    host's GPUs are of several models (a server's binaries would not suit another's GPU)."""
    try:
        models = sorted(re.search(r"^Model:\s*(.+)$", (gpu / "information").read_text(), re.M).group(1).strip()
                        for gpu in (driver_folder / "gpus").iterdir())
        driver = (driver_folder / "version").read_text().splitlines()[0]
    except (OSError, AttributeError, IndexError):
        return None
    if len(set(models)) != 1:
        return None
    packages = [f"{name}=={version}" for name, version in mlx_and_cuda_packages().items()]
    return json.dumps({"gpus": models, "driver": driver, "packages": packages}, sort_keys=True)


def mlx_and_cuda_packages() -> dict:
    """name -> version of the installed mlx, mlx-vlm, mlx-cuda or mlx-metal and CUDA library
    (nvidia-*) wheels, by name."""
    return dict(sorted((dist.metadata["Name"].lower(), dist.version) for dist in importlib.metadata.distributions()
                       if (dist.metadata["Name"] or "").lower().startswith(("mlx", "nvidia-"))))


def setup_folder_name(setup: str) -> str:
    return hashlib.sha256(setup.encode()).hexdigest()[:16]


def whole_binary(path: Path) -> bool:
    """Whether a cache entry's binary is whole: a cubin (ELF) whose program and section header
    tables lie inside it (a cut one's end is missing), or PTX text (no NUL in its first 64
    bytes) with its final NUL. Reads its first 64 bytes and its last."""
    with open(path, "rb") as file:
        head, size = file.read(64), os.fstat(file.fileno()).st_size
        if head[:4] == b"\x7fELF":
            if len(head) < 64:
                return False
            phoff, shoff = struct.unpack_from("<QQ", head, 0x20)
            phentsize, phnum, shentsize, shnum = struct.unpack_from("<HHHH", head, 0x36)
            return phoff + phentsize * phnum <= size and shoff + shentsize * shnum <= size
        if not head or b"\0" in head[:size - 1]:  # a NUL only as its last byte
            return False
        file.seek(size - 1)
        return file.read(1) == b"\0"


def remove_cut_entries(folder: Path) -> int:
    """Removes every entry (a .ptx binary and its .txt kernel names, a line each) MLX could not
    load: a binary not whole, names missing, empty or cut within a line. Returns how many; an
    entry it cannot remove stays (MLX then fails that op, as it would have)."""
    removed = 0
    for binary in sorted(folder.rglob("*.ptx")):
        names = binary.with_suffix(".txt")
        try:
            if not binary.is_file() or (whole_binary(binary) and names.read_bytes().endswith(b"\n")):
                continue
        except OSError:
            pass
        try:
            binary.unlink(missing_ok=True)
            names.unlink(missing_ok=True)
            removed += 1
        except OSError:
            continue
    return removed
