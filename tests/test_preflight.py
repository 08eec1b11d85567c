"""The disk check before a test run (tests/preflight.py): needs on one disk add up."""

from __future__ import annotations

import os
from pathlib import Path

from preflight import GIB, shortfall


def test_needs_of_folders_on_one_disk_add_up(tmp_path: Path) -> None:
    dev = os.stat(tmp_path).st_dev
    needs = {tmp_path / "a": 2 * GIB, tmp_path / "not" / "made" / "yet": 3 * GIB}
    assert shortfall(needs, {dev: 5 * GIB}) is None
    why = shortfall(needs, {dev: 4 * GIB})
    assert why is not None
    assert "needs 5.0 GiB" in why and "has 4.0 GiB" in why and str(tmp_path / "a") in why
