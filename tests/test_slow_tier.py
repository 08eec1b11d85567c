"""The slow tier is what the README says it is: the tests marked slow (the packaging builds,
the real agent clients, the tests on Qwen2.5-Coder) run in CI or with NPU_PROXY_SLOW_TESTS=1
and are skipped, with the reason, in a plain `make test` (tests/conftest.py SLOW_TIER)."""

from __future__ import annotations

import pytest
from installed import SLOW, SLOW_REASON, known_skips


def test_the_slow_tier_runs_only_where_asked(request: pytest.FixtureRequest) -> None:
    items = request.session.items
    marked = [item.nodeid for item in items if item.get_closest_marker("slow") is not None]
    loops = [item.nodeid for item in items if "test_client_tool_loop.py" in item.nodeid]
    assert set(loops) <= set(marked)
    skipped = [item.nodeid for item in items if SLOW_REASON in known_skips(item)]
    assert skipped == ([] if SLOW else marked)
