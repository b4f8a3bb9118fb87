"""Writes a tool's evidence record: the JSON and its Markdown summary, side by side."""

import hashlib
import json
import os
import platform
import shlex
import sys
from pathlib import Path


def write_record(out, stem: str, record: dict, markdown: str) -> Path:
    """OUT/STEM.json and OUT/STEM.md; returns the JSON path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    return out / f"{stem}.json"


def run_environment(tool: str, pack: str, argv=None) -> dict:
    """A record's header: where and with what it ran, the command that wrote it."""
    import mlx.core as mx
    import mlx_vlm

    import dflash2_kernels

    return {
        "backend": dflash2_kernels.backend_name(),
        "device": mx.device_info().get("device_name", platform.machine()),
        "versions": {
            "mlx": mx.__version__,
            "mlx_vlm": mlx_vlm.__version__,
            "python": platform.python_version(),
        },
        "command": "python " + shlex.join([f"tools/{tool}", *(sys.argv[1:] if argv is None else argv)]),
        "pack": pack,
        "code": code_digest(),
        # MLX reads these from the environment (on CUDA: graph sizes, the graph cache): what
        # the process ran with, the runtime's own defaults included.
        "mlx_environment": {name: value for name, value in sorted(os.environ.items()) if name.startswith("MLX_")},
    }


def code_digest() -> str:
    """sha256 (first 12 hex digits) of the pack's top-level Python files and the tools: which
    code a record measured, also where the device's copy of the tree has no git history."""
    root = Path(__file__).resolve().parent.parent
    digest = hashlib.sha256()
    for path in sorted([*root.glob("*.py"), *root.glob("tools/*.py")]):
        digest.update(path.relative_to(root).as_posix().encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()[:12]
