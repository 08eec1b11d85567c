from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from serverctl import Server

LLM = "smollm2:135m"


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    """One real server (gateway + CPU LLM worker + embedding worker + rerank worker, the
    default workers) shared by the suite."""
    srv = Server(tmp_path_factory.mktemp("server")).start()
    yield srv
    srv.stop()


@pytest.fixture(scope="session")
def base_url(server: Server) -> str:
    return server.url


@pytest.fixture(scope="session")
def tiny_vlm_path() -> Path:
    """The tiny test VLM's IR folder (tests/tiny_vlm.py), built on first use per machine."""
    from serverctl import MODEL_CACHE
    from tiny_vlm import ensure

    return ensure(MODEL_CACHE)


@pytest.fixture(scope="session")
def frozen_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The PyInstaller one-folder build of the tree, made once for the slow tests that use
    it (the folder itself, the Debian package)."""
    from installed import freeze

    return freeze(tmp_path_factory.mktemp("frozen"))
