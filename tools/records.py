"""Writes a tool's evidence record: the JSON and its Markdown summary, side by side."""

import json
from pathlib import Path


def write_record(out, stem: str, record: dict, markdown: str) -> Path:
    """OUT/STEM.json and OUT/STEM.md; returns the JSON path."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"{stem}.json").write_text(json.dumps(record, indent=1) + "\n")
    (out / f"{stem}.md").write_text(markdown)
    return out / f"{stem}.json"
