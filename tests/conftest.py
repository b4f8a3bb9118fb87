"""Shared fixtures. Keep each one small; add yours below."""

import pytest


@pytest.fixture(scope="session")
def tiny_pack(tmp_path_factory):
    """The tiny synthetic pack (seed 0, bf16 drafter), built once per test session.
    Returns {"root", "target", "drafter"} paths. Treat it as read-only: copy it before
    changing anything."""
    from make_synthetic_pack import make_pack

    return make_pack(tmp_path_factory.mktemp("tiny_pack"), size="tiny", seed=0)
