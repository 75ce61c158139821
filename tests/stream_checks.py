"""What a stream run must leave behind, checked from its files: every prompt of the data order trained
on at most once, none skipped, no group older than the lag bound in the loss (shared by the stream
fault tests)."""

from __future__ import annotations

import json
from pathlib import Path


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_every_prompt_trained_at_most_once_and_none_skipped(
    out: Path,
    *,
    steps: int,
    prompts_per_step: int,
    num_generators: int,
    samples_per_prompt: int = 2,
    max_policy_lag: int = 1,
    none_dropped: bool = True,
) -> None:
    """From the files a run leaves: samples.rank*.jsonl (every group sampled, by its position in the data
    order) and trained_groups.jsonl (the groups each step trained on). With `none_dropped`, no group was
    dropped as stale either (admission control keeps generators from sampling what would be)."""
    share = prompts_per_step // num_generators
    sampled: list[int] = []
    for g in range(num_generators):
        rows = read_jsonl(out / f"samples.rank{1 + g}.jsonl")
        positions = [r["position"] for r in rows]
        groups = sorted(set(positions))
        assert all(positions.count(p) == samples_per_prompt for p in groups), "a group sampled twice or cut"
        # This generator's share of the data order, from its start, with no gap: none skipped.
        expected = [(k // share) * prompts_per_step + g * share + k % share for k in range(len(groups))]
        assert groups == expected, (g, groups, expected)
        sampled += groups
    trained = read_jsonl(out / "trained_groups.jsonl")
    assert [t["step"] for t in trained] == list(range(1, steps + 1))
    positions = [p for t in trained for p in t["positions"]]
    assert len(positions) == len(set(positions)) == steps * prompts_per_step  # each at most once
    assert set(positions) <= set(sampled)
    for t in trained:  # no group older than the lag bound reached the loss
        assert all(t["step"] - 1 - v <= max_policy_lag for v in t["oldest_versions"]), t
    summary = json.loads((out / "summary.json").read_text())
    assert summary["final_policy_version"] == steps and summary["steps"] == steps
    counts = summary["stream"]
    # Every group sampled is accounted for: trained, dropped as stale, still buffered at the end, or
    # arriving after the last step.
    left = counts["dropped_stale_groups"] + counts["unused_groups"] + counts["discarded_groups"]
    assert len(sampled) == steps * prompts_per_step + left
    if none_dropped:
        assert counts["dropped_stale_groups"] == 0
