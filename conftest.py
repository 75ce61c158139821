"""Suite-wide rule: no test may skip. A skipped (or expected-to-fail) test checks nothing, so CI must not go
green with one; every test of this workspace runs here, the real-engine ones included.

pytest loads this file for every test under the workspace root (the root is the rootdir: pyproject.toml
holds the pytest settings). A skip is turned into a failure of that test, and a module or class skipped
at collection into a failed collection, each naming the reason given for the skip, so the run's exit
status is non-zero.
"""

from __future__ import annotations

import pytest

RULE = "the suite runs every test: a skip is a failure here"


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    """The reason a report gives for its skip (pytest keeps it as (path, line, message) or as text)."""
    if getattr(report, "wasxfail", None) is not None:
        return f"xfail: {report.wasxfail}" if report.wasxfail else "xfail"
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")
    return str(longrepr)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> object:
    outcome = yield
    report: pytest.TestReport = outcome.get_result()
    if report.skipped:
        reason = _reason(report)
        if hasattr(report, "wasxfail"):
            del report.wasxfail  # else pytest's summary would still count it as an xfail
        report.outcome = "failed"
        report.longrepr = f"{item.nodeid} skipped ({reason}): {RULE}"


@pytest.hookimpl(hookwrapper=True)
def pytest_make_collect_report(collector: pytest.Collector) -> object:
    outcome = yield
    report: pytest.CollectReport = outcome.get_result()
    if report.skipped:
        reason = _reason(report)
        report.outcome = "failed"
        report.longrepr = f"{collector.nodeid} skipped at collection ({reason}): {RULE}"
