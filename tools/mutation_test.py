"""Mutation testing of one package: how many small deliberate bugs (mutants) its tests catch.

    nice -n 10 uv run tools/mutation_test.py algo          # packages/llamarl-algo from scratch
    nice -n 10 uv run tools/mutation_test.py algo --keep   # reuse the last run, test what is not yet done

mutmut copies the package's sources and tests into `packages/llamarl-<name>/mutants/` (git-ignored),
writes every mutant into that copy behind a switch, records which tests run each function, then runs only
those tests against each mutant, in forked workers. A mutant is killed when a test fails.

What to mutate and how to run pytest are mutmut's settings in the package's pyproject.toml, table
[tool.mutmut]; mutmut reads them from the folder it runs in. Adding a package takes that table and,
for its score and equivalent mutants, a mutation.toml beside it: nothing here changes. `source_paths`
must be the whole `src/llamarl/<name>` folder (the copy has to import as the package) and `only_mutate`
picks files within it, e.g. for comm's transfer plan and buckets, or control's schedule, buffer and
evaluation:

    [tool.mutmut]
    source_paths = ["src/llamarl/comm"]
    only_mutate = ["src/llamarl/comm/plan.py", "src/llamarl/comm/buckets.py"]
    pytest_add_cli_args_test_selection = ["tests"]
    pytest_add_cli_args = ["--import-mode=importlib", "-p", "no:cacheprovider"]

The score is killed / (mutants - equivalent ones). mutation.toml lists the equivalent mutants, those no
test can kill because no behaviour changes, each with the line mutmut wrote and the reason. An entry whose
mutant is killed, gone or now a different line fails the run (mutants are numbered per function and
renumber when it changes), so the list cannot quietly cover a real survivor. Exit status 1 when the score
is below the file's `fail_under` or the list is stale.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tomllib
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DETECTED = ("killed", "timeout")
"""Statuses that count as caught: a mutant that makes the tests run past mutmut's limit broke them too."""


@dataclass(frozen=True)
class Equivalent:
    """An entry of mutation.toml: a mutant that no test can kill, the line it writes, and why."""

    mutant: str
    line: str
    reason: str


def _mutmut(package_dir: Path, *args: str, capture: bool = False) -> str:
    """Runs `mutmut ARGS` in the package's folder (where mutmut finds its [tool.mutmut] settings)."""
    env = {
        **os.environ,
        # One thread per worker: mutmut forks one per core already, and torch's intra-op threads in
        # forked children only fight over the same cores.
        "OMP_NUM_THREADS": "1",
        # Hypothesis without shrinking (tests/conftest.py): a mutant is killed by the first failure.
        "LLAMARL_HYPOTHESIS_PROFILE": "mutation",
    }
    result = subprocess.run(
        [sys.executable, "-m", "mutmut", *args],
        cwd=package_dir,
        env=env,
        check=True,
        text=True,
        stdout=subprocess.PIPE if capture else None,
    )
    return result.stdout or ""


def _statuses(package_dir: Path) -> dict[str, str]:
    """Mutant name -> status ("killed", "survived", "timeout", "no tests", ...) of the last run."""
    statuses = {}
    for line in _mutmut(package_dir, "results", "--all", "true", capture=True).splitlines():
        name, sep, status = line.strip().rpartition(": ")
        if sep and name:
            statuses[name] = status
    return statuses


# Prints the diff of each named mutant, then a marker line: one process for all of them, where one
# `mutmut show` per mutant would cost a start-up each (seconds on a loaded machine).
_DIFFS_SCRIPT = """
import sys
from mutmut.mutation.diff_apply import get_diff_for_mutant
for name in sys.argv[1:]:
    print(get_diff_for_mutant(name))
    print("@@@ end of mutant")
"""


def _mutated_lines(package_dir: Path, mutants: list[str]) -> dict[str, list[str]]:
    """Mutant name -> the lines that it adds, from mutmut's diff of the mutant against the original."""
    if not mutants:
        return {}
    output = subprocess.run(
        [sys.executable, "-c", _DIFFS_SCRIPT, *mutants],
        cwd=package_dir,
        check=True,
        text=True,
        stdout=subprocess.PIPE,
    ).stdout
    diffs = output.split("@@@ end of mutant\n")
    return {
        name: [
            line[1:].strip()
            for line in diff.splitlines()
            if line.startswith("+") and not line.startswith("+++")
        ]
        for name, diff in zip(mutants, diffs, strict=False)
    }


def _load_settings(package_dir: Path) -> tuple[float, list[Equivalent]]:
    """`fail_under` and the equivalent mutants from the package's mutation.toml (none without one)."""
    path = package_dir / "mutation.toml"
    if not path.exists():
        return 0.0, []
    data = tomllib.loads(path.read_text())
    equivalents = [Equivalent(e["mutant"], e["line"], e["reason"]) for e in data.get("equivalent", [])]
    return float(data.get("fail_under", 0.0)), equivalents


def _stale_entries(
    statuses: dict[str, str], equivalents: list[Equivalent], lines: dict[str, list[str]]
) -> list[str]:
    """Entries of the equivalents list that no longer describe a surviving mutant of that line."""
    problems = []
    for entry in equivalents:
        status = statuses.get(entry.mutant)
        if status is None:
            problems.append(f"{entry.mutant}: no such mutant")
        elif status != "survived":
            problems.append(f"{entry.mutant}: listed as equivalent but {status}")
        elif entry.line.strip() not in lines.get(entry.mutant, []):
            problems.append(f"{entry.mutant}: now mutates another line than {entry.line!r}")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("package", help="the package's short name: algo for packages/llamarl-algo")
    parser.add_argument("--keep", action="store_true", help="reuse mutants/ and the results of the last run")
    parser.add_argument("--report-only", action="store_true", help="report the last run, run nothing")
    parser.add_argument("--jobs", type=int, default=2, help="forked test workers (default 2)")
    args = parser.parse_args()

    package_dir = ROOT / "packages" / f"llamarl-{args.package}"
    pyproject = package_dir / "pyproject.toml"
    if not pyproject.exists() or "mutmut" not in tomllib.loads(pyproject.read_text()).get("tool", {}):
        print(f"{pyproject.relative_to(ROOT)} has no [tool.mutmut] table: nothing to mutate", file=sys.stderr)
        return 2
    if not args.report_only:
        if not args.keep:
            shutil.rmtree(package_dir / "mutants", ignore_errors=True)
        _mutmut(package_dir, "run", "--max-children", str(args.jobs))

    statuses = _statuses(package_dir)
    fail_under, equivalents = _load_settings(package_dir)
    excluded = {e.mutant for e in equivalents}
    survivors = sorted(
        name for name, status in statuses.items() if status not in DETECTED and name not in excluded
    )
    listed = sorted(e.mutant for e in equivalents if statuses.get(e.mutant) == "survived")
    lines = _mutated_lines(package_dir, survivors + listed)
    stale = _stale_entries(statuses, equivalents, lines)
    counts = Counter(statuses.values())
    detected = sum(counts[status] for status in DETECTED)
    scored = len(statuses) - len(excluded & statuses.keys())
    score = 100.0 * detected / scored if scored else 0.0

    summary = ", ".join(f"{n} {status}" for status, n in counts.most_common())
    print(f"\nllamarl-{args.package}: {len(statuses)} mutants: {summary}")
    for name in survivors:
        print(f"  not killed ({statuses[name]}): {name}: {' | '.join(lines[name])}")
    for problem in stale:
        print(f"  stale entry in mutation.toml: {problem}")
    raw = 100.0 * detected / max(len(statuses), 1)
    print(
        f"mutation score: {detected}/{scored} = {score:.1f}% killed, {len(excluded)} equivalent mutants"
        f" excluded ({detected}/{len(statuses)} = {raw:.1f}% of all mutants); fail_under {fail_under}%"
    )
    return 1 if stale or score < fail_under else 0


if __name__ == "__main__":
    sys.exit(main())
