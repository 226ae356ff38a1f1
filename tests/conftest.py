"""pytest hooks for the suite: the rank groups ``dist_harness.run_ranks`` shares end with the session."""

from __future__ import annotations

from dist_harness import close_groups


def pytest_sessionfinish(session, exitstatus):
    close_groups()
