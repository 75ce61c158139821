"""Checkpoints written before rank states had a format, read as today's: the old keys, in one place.

Today's rank states (`rank{r}.pt`) carry `"format": RANK_STATE_FORMAT`; each side's state reads only
that format, through the function of this module for it, which passes a current state through and
converts an older one (format 1: no "format" key). The run's state (`controller.json`) kept its keys;
only checkpoints from before OUTPUT_DIR/trained_groups.jsonl lack one of them.
Format 1 kept batches as `(tensors, group_size)` tuples, a generator's stream work as loose keys
(`request`, `in_flight`, `undelivered`, `tickets`, `held`), and the trainer's stream state under
"stream". The conversions also read the states of before admission tickets (a buffer in arrival order,
a generator with no tickets), which the format-1 code still read. Delete this module once no format-1
checkpoint needs resuming.
"""

from __future__ import annotations

from typing import Any

from llamarl.control.run.checkpoint import RANK_STATE_FORMAT

State = dict[str, Any]


def generator_state(state: State) -> State:
    """A generator rank's state (`GeneratorRankState`) in today's format."""
    if _current(state):
        return state
    return {
        "prompt_position": state["prompt_position"],
        "generator_totals": state["generator_totals"],
        "pending": _pending(state["pending"]),
        "work": _work(state.get("stream")),
        "samples_bytes": state["samples_bytes"],
        "eval_samples_bytes": 0,  # evaluation answers were written nowhere then
    }


def reward_state(state: State) -> State:
    """A reward rank's state (`RewardRankState`) in today's format."""
    if _current(state):
        return state
    return {
        "scored": {g: _pending((tensors, G, metrics)) for g, tensors, G, metrics in state["pending"]},
        "totals": state["totals"],
        "scores_bytes": state["scores_bytes"],
    }


def trainer_state(state: State) -> State:
    """A trainer rank's state (`TrainerRankState`) in today's format."""
    if _current(state):
        return state
    stream = state.get("stream")
    intake = None
    if stream is not None:
        intake = {
            "buffer": buffer_state(stream["buffer"]),
            "admission": stream["admission"],
            "discarded": stream["discarded"],
        }
    return {"intake": intake}


def run_state(state: State) -> State:
    """The run's state from controller.json (`TrainerRunState`) in today's format."""
    return {**state, "trained_bytes": state.get("trained_bytes", 0)}  # 0: before trained_groups.jsonl


def _current(state: State) -> bool:
    return state.get("format") == RANK_STATE_FORMAT


def _batch(tensors: State, group_size: int) -> State:
    return {**tensors, "group_size": group_size}  # RolloutBatch.state()


def _pending(old: tuple | None) -> State | None:
    if old is None:
        return None
    tensors, group_size, metrics = old
    return {"batch": _batch(tensors, group_size), "metrics": metrics}  # PendingBatch.state()


def buffer_state(old: State) -> State:
    """A RolloutBuffer's state; one from before tickets holds its groups in arrival order."""
    counts = old["counts"]
    if "next" in old:
        entries, next_ticket = old["groups"], old["next"]
    else:
        next_ticket = counts["taken"] + counts["dropped_stale"]
        entries = [(next_ticket + i, *entry) for i, entry in enumerate(old["groups"])]
    return {
        "groups": {t: _batch(tensors, group_size) for t, tensors, group_size in entries},
        "next": next_ticket,
        "arrivals": old.get("arrivals", next_ticket + len(entries)),
        "gone": list(old.get("gone", [])),
        "counts": counts,
        "in_admission_order": "next" in old,
    }


def _work(old: State | None) -> State | None:
    """A generator's stream work in hand (`WorkInHand.state()`). Format 1 kept the request's prompts
    (`request`) with its completions so far (`in_flight`), or the batch made from it (`undelivered`)."""
    if old is None:  # a checkpoint from before stream checkpoints
        return None
    request = None
    if old["undelivered"] is not None:
        tensors, group_size, metrics = old["undelivered"]
        request = {
            "state": "made",
            "positions": tensors["prompt_position_B"][::group_size].tolist(),
            "in_flight": None,
            "made": _pending((tensors, group_size, metrics)),
        }
    elif old["request"] is not None:
        in_flight = old["in_flight"]
        request = {
            "state": "admitted" if in_flight is None else "paused",
            "positions": list(old["request"]),
            "in_flight": None
            if in_flight is None
            else {
                "batch": _batch(in_flight["batch"], in_flight["group_size"]),
                "finished_B": in_flight["finished_B"],
            },
            "made": None,
        }
    if request is not None:  # the last request started; its tickets are every ticket in hand
        request |= {"number": old["requests"] - 1, "tickets": dict(old.get("tickets", {}))}
    return {"request": request, "requests": old["requests"], "held": list(old.get("held", []))}


def evaluation(result: State) -> State:
    """An evaluation of controller.json (`EvalResult.as_dict()`) in today's fields: older runs kept only
    rewards, under the names greedy_Q and sampled_Q (and called their mean the accuracy)."""
    if "greedy_Q" not in result:
        return result
    return {
        "policy_version": result["policy_version"],
        "greedy_reward_Q": result["greedy_Q"],
        "sampled_reward_Q": result.get("sampled_Q"),
    }
