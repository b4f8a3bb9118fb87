"""Imports the pack's own modules from their source files alone, and nothing else from its folder.

Both servers run this file first, before importing anything but sys (through runpy, which
compiles it from its source), with their folder already taken off sys.path. The launch checks
hash the pack's .py files against dflash2-pack.json, but no check covers other files in the
folder, and Python would run them: a compiled file in __pycache__ in a module's place (an
unchecked hash-based one whatever the source says, a timestamp-checked one whose recorded
mtime and size match), or a module file beside the pack's that shadows one of the standard
library or a package (logging.py, uvicorn.py). So the folder serves only the pack's
dflash2_*.py modules, each compiled from its source, and no bytecode is written there.
"""

import importlib.machinery
import importlib.util
import os
import sys


class SourceOnlyLoader(importlib.machinery.SourceFileLoader):
    """A module compiled from its .py at every import; no bytecode cache read or written."""

    def get_code(self, fullname):
        return self.source_to_code(self.get_data(self.path), self.path)


class PackModuleFinder:
    """The pack's own modules (dflash2_*.py in its folder), through SourceOnlyLoader."""

    def __init__(self, folder: str):
        self.folder = folder

    def find_spec(self, name, path=None, target=None):
        if "." in name or not name.startswith("dflash2_"):
            return None
        location = os.path.join(self.folder, f"{name}.py")
        if not os.path.isfile(location):
            return None
        return importlib.util.spec_from_file_location(name, location, loader=SourceOnlyLoader(name, location))


def load_from_source(folder: str):
    """The pack's modules from `folder`, first among the import system's finders."""
    sys.meta_path.insert(0, PackModuleFinder(folder))
