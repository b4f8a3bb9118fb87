"""Imports the pack's own modules from their source files alone.

Both servers run this file before importing anything of the pack (through runpy, which
compiles it from its source). The launch checks hash the pack's .py files against
dflash2-pack.json, but Python would run a compiled file from the pack's __pycache__ in a
module's place: an unchecked hash-based one whatever the source says, a timestamp-checked
one whose recorded mtime and size match. No check covers those files, so none is read; and
none is written, so running a pack leaves its folder as downloaded.
"""

import importlib.machinery
import sys


class SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """A module compiled from its .py at every import; no bytecode cache read or written."""

    def get_code(self, fullname):
        return self.source_to_code(self.get_data(self.path), self.path)


def load_from_source(folder: str):
    """Modules that Python finds in `folder` (a sys.path entry) load through SourceOnlyLoader."""
    sys.path_importer_cache[folder] = importlib.machinery.FileFinder(folder, (SourceOnlyLoader, [".py"]))
