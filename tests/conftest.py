from __future__ import annotations

from collections.abc import Iterator

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
