"""torch.compile's caches in a folder of the test session, for every test (autouse)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def session_compile_cache(tmp_path_factory, monkeypatch):
    """torch.compile's caches in one folder of the test session (of each worker), set again at every
    test's start: a run (``trainer.compile_cache: auto``) points them at ~/.cache/hybridrl for its
    process, which must reach neither the user's home nor the tests after it."""
    folder = tmp_path_factory.getbasetemp() / "compile-cache"
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(folder))
    monkeypatch.setenv("TRITON_CACHE_DIR", str(folder / "triton"))
