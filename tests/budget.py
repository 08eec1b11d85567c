"""The suite's budget by module (issue 46): after `--durations`' slowest tests, the modules
that took the most wall time, setup and teardown included (a module's own server starts in
its first test's setup), so the place to save time is visible in every run's output. And the
tests that needed more than one run of a real client (a `retried` property: tests
test_client_tool_loop.py), so that a pass after a failed run is seen too."""

from __future__ import annotations

from collections import defaultdict

import pytest

SHOWN = 15
_spent: defaultdict[str, float] = defaultdict(float)
_retried: list[str] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    _spent[report.nodeid.split("::", 1)[0]] += report.duration
    _retried.extend(f"{report.nodeid}: {value}" for name, value in report.user_properties
                    if name == "retried" and report.when == "call")


@pytest.hookimpl(trylast=True)
def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter) -> None:
    if _retried:
        terminalreporter.write_sep("=", "runs that did not complete, then another did or not")
        for line in _retried:
            terminalreporter.write_line(line)
    if not _spent:
        return
    total = sum(_spent.values())
    terminalreporter.write_sep("=", f"slowest {SHOWN} modules ({total:.0f} s in tests)")
    for module, seconds in sorted(_spent.items(), key=lambda kv: -kv[1])[:SHOWN]:
        terminalreporter.write_line(f"{seconds:8.1f}s {100 * seconds / total:5.1f}%  {module}")
