"""The soak run's report: the tables docs/reliability.md is made from, printed at the end of the
session whatever the verdicts (tests/conftest.py, one level up, already put tests/ on sys.path
for daemon_harness and rtsp_peer, and the loopback-only LSL configuration in place)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

_REPORT = pytest.StashKey[list]()


@pytest.fixture(scope="session")
def soak_report(pytestconfig) -> list[str]:
    """Lines of the report; the soak test appends, the terminal summary prints them."""
    return pytestconfig.stash.setdefault(_REPORT, [])


def pytest_terminal_summary(terminalreporter, config):
    lines = config.stash.get(_REPORT, [])
    if not lines:
        return
    terminalreporter.section("facecast soak report (paste into docs/reliability.md)")
    for line in lines:
        terminalreporter.write_line(line)
    path = os.environ.get("FACECAST_SOAK_REPORT")
    if path:
        Path(path).write_text("\n".join(lines) + "\n")
        terminalreporter.write_line(f"(written to {path})")
