"""What the kernel tests share."""

import sys


def patch_kernels(monkeypatch, name: str, value):
    """monkeypatch.setattr(module, name, value) on every kernel module that binds `name`: the
    face re-exports what the families define, and each family looks up its own binding of a
    shared name (backend_name, say)."""
    for module_name, module in sorted(sys.modules.items()):
        if module_name.startswith("dflash2_kernel") and hasattr(module, name):
            monkeypatch.setattr(module, name, value)
