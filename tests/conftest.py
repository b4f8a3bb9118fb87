"""Shared fixtures and helpers. Keep each one small; add yours below."""

import pytest


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory):
    """The tiny synthetic pack (seed 0, bf16 drafter), built once per test session.
    Returns {"root", "target", "drafter"} paths. Treat it as read-only: copy it before
    changing anything."""
    from make_synthetic_pack import make_pack

    return make_pack(tmp_path_factory.mktemp("tiny_pack"), size="tiny", seed=0)


@pytest.fixture
def gpu_like_rounding(monkeypatch):
    """While active, matmuls over several rows, attention over several queries and stock
    verify's multi-step recurrence round differently from their one-row calls, as on
    GPUs; one-row calls stay MLX's own (tests/gpu_rounding.py says which ops and how)."""
    from gpu_rounding import swap_row_variant_ops

    swap_row_variant_ops(monkeypatch)


def flip_byte(path, offset: int):
    """Flips one bit of the byte at offset (negative: from the end), size unchanged."""
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))
