"""The root conftest.py: its suite-wide rule (a test that skips fails the run, in every form a skip takes:
pytest.skip in a test or a fixture, a skip mark, xfail, a module skipped at collection), and the CPU it
names in the header of every run (a failure says which hardware it came from)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

PROBES = {
    "test_skips.py": """
import pytest

@pytest.fixture
def engine():
    pytest.skip("no engine in a fixture")

def test_passes():
    pass

def test_skips_itself():
    pytest.skip("no engine")

def test_skips_in_its_fixture(engine):
    pass

@pytest.mark.skip(reason="marked")
def test_marked():
    pass

@pytest.mark.skipif(True, reason="a condition")
def test_skipped_if():
    pass

@pytest.mark.xfail(reason="known bug")
def test_expected_to_fail():
    assert False
""",
    "test_module_skipped.py": """
import pytest

pytest.skip("the whole module", allow_module_level=True)

def test_never_collected():
    pass
""",
}


def _run_pytest(folder: Path, *args: str) -> subprocess.CompletedProcess:
    # The folder is its own rootdir (an empty pytest.ini) holding a copy of the workspace's conftest.py,
    # so the rule is tested as pytest loads it, away from the workspace's own tests and settings.
    (folder / "pytest.ini").write_text("[pytest]\n")
    (folder / "conftest.py").write_text((REPO / "conftest.py").read_text())
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", "-rA", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.timeout(180)
def test_every_kind_of_skip_fails_the_run_and_names_its_reason(tmp_path):
    for name, text in PROBES.items():
        (tmp_path / name).write_text(text)
    # (A failed collection would end the run before the tests; here it runs them all to show each.)
    result = _run_pytest(tmp_path, "--continue-on-collection-errors", *PROBES)
    out = result.stdout
    assert result.returncode == 1, out[-3000:]
    for test, reason in (
        ("test_skips_itself", "no engine"),
        ("test_skips_in_its_fixture", "no engine in a fixture"),
        ("test_marked", "marked"),
        ("test_skipped_if", "a condition"),
        ("test_expected_to_fail", "xfail: known bug"),
    ):
        assert f"test_skips.py::{test} skipped ({reason}): the suite runs every test" in out, (test, out)
    assert "test_module_skipped.py skipped at collection (the whole module)" in out, out
    assert "PASSED test_skips.py::test_passes" in out
    # Nothing is left reported as skipped or xfailed: every one of them became a failure or an error.
    summary = out.strip().splitlines()[-1]
    assert "skipped" not in summary and "xfail" not in summary, summary
    assert "1 passed" in summary, summary


@pytest.mark.timeout(180)
def test_a_run_without_skips_passes(tmp_path):
    (tmp_path / "test_fine.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    result = _run_pytest(tmp_path, "test_fine.py")
    assert result.returncode == 0, result.stdout[-3000:]
    assert "1 passed" in result.stdout


@pytest.mark.timeout(180)
def test_the_report_header_names_the_cpu_and_the_flags_that_matter(tmp_path):
    (tmp_path / "test_fine.py").write_text("def test_one():\n    assert 1 + 1 == 2\n")
    result = _run_pytest(tmp_path, "test_fine.py")
    [header] = [line for line in result.stdout.splitlines() if line.startswith("cpu: ")]
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.+)$", cpuinfo, re.MULTILINE).group(1).strip()
    flags = set(re.search(r"^flags\s*:\s*(.+)$", cpuinfo, re.MULTILINE).group(1).split())
    listed = " ".join(
        f if f in flags else f"-{f}" for f in ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")
    )
    assert header == f"cpu: {model} ({len(os.sched_getaffinity(0))} cores); {listed}", header


@pytest.mark.parametrize("args", [["-k", "vllm"], ["--deselect", "tests/test_rl_apps.py"], ["tests"]])
def test_ci_entry_point_takes_no_arguments_that_could_drop_tests(args):
    # Refused before anything is installed or built: the check is the script's first step.
    result = subprocess.run(
        ["bash", str(REPO / ".ci" / "run"), *args], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 2
    assert result.stderr.strip() == f".ci/run takes no arguments (it runs every test); got: {' '.join(args)}"
