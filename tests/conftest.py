"""pytest hooks for the suite: the rank groups ``dist_harness.run_ranks`` shares within a test file end with the
session."""

from __future__ import annotations

from dist_harness import close_groups


def pytest_sessionfinish(session, exitstatus):
    close_groups()
