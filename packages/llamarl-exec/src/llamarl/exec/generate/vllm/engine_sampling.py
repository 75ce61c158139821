"""The engine process's sampling bookkeeping (vLLM environment): the parameters every request is sampled
with, the completions of a generate as its steps come in, and the model turns of multi-turn episodes.

Every token is stamped with the policy version of the weights whose forward pass drew it (`version`
as the engine step ran): a weight sync may land between two steps (`server.py`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from llamarl.exec.generate.vllm.protocol import GenerateReply, ProgressReply, Turn, TurnDone


def sampling_params(
    *, n: int, temperature: float, max_tokens: int, stop_token_ids: list[int], seed: int | None
) -> Any:
    """vLLM `SamplingParams` for temperature sampling alone (0: greedy): every other knob set to its
    neutral value explicitly, since the tokens must come from softmax(z / T), which the log-probs
    (`logprobs=0`: the sampled token's only) describe; each step's new tokens delivered on their own
    (DELTA), so that each gets the version that drew it."""
    from vllm import SamplingParams
    from vllm.sampling_params import RequestOutputKind

    return SamplingParams(
        n=n,
        temperature=temperature,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        presence_penalty=0.0,
        frequency_penalty=0.0,
        repetition_penalty=1.0,
        max_tokens=max_tokens,
        min_tokens=0,
        stop_token_ids=stop_token_ids,
        logprobs=0,
        seed=seed,
        output_kind=RequestOutputKind.DELTA,
    )


def add_prompts(
    llm: Any, request_ids: list[str], prompts: list[list[int]], params: Any, added: list[str]
) -> None:
    """Adds one engine request per prompt (token ids), appending each id to `added` once it is in the
    engine (what to abort if the call goes wrong half way)."""
    from vllm.inputs import TokensPrompt

    raw = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
    # Rendered as LLM.generate renders them (vLLM 0.32 deprecates handing raw prompts to the engine);
    # raw where an LLM lacks that private step.
    render = getattr(llm, "_preprocess_cmpl", None)
    for request_id, prompt in zip(request_ids, raw if render is None else render(raw), strict=True):
        llm.llm_engine.add_request(request_id, prompt, params)
        added.append(request_id)


def _sampled(completion: Any) -> tuple[list[int], list[float]]:
    """A completion output's new tokens and the log-prob of each."""
    ids = list(completion.token_ids)
    return ids, [step[t].logprob for step, t in zip(completion.logprobs, ids, strict=True)]


class Completions:
    """The completions of one generate as the engine steps them: row `i * n + j` is sample j of the
    prompt of request `request_ids[i]`."""

    def __init__(self, request_ids: list[str], n: int) -> None:
        self.n = n
        self.slot = {rid: i for i, rid in enumerate(request_ids)}
        num = len(request_ids) * n
        self.token_ids: list[list[int]] = [[] for _ in range(num)]
        self.logprobs: list[list[float]] = [[] for _ in range(num)]
        self.versions: list[list[int | None]] = [[] for _ in range(num)]
        self.arrivals: list[list[tuple[int, int | None]]] = [[] for _ in range(num)]
        self.finished = [False] * num

    def record(self, outputs: Iterable[Any], version: int | None) -> None:
        """One engine step's outputs, drawn by the weights of `version`."""
        for output in outputs:
            for completion in output.outputs:
                row = self.slot[output.request_id] * self.n + completion.index
                ids, logprobs = _sampled(completion)
                self.token_ids[row] += ids
                self.logprobs[row] += logprobs
                self.versions[row] += [version] * len(ids)
                self.finished[row] = self.finished[row] or completion.finished()

    def note_version(self, version: int | None) -> None:
        """New weights (`version`) arrived: where each unfinished completion was then."""
        for row, done in enumerate(self.finished):
            if not done:
                self.arrivals[row].append((len(self.token_ids[row]), version))

    def progress(self) -> ProgressReply:
        return ProgressReply(tokens=[len(ids) for ids in self.token_ids], finished=list(self.finished))

    def reply(self, *, paused: bool, policy_version: int | None) -> GenerateReply:
        return GenerateReply(
            token_ids=self.token_ids,
            logprobs=self.logprobs,
            token_versions=self.versions,
            finished=self.finished,
            paused=paused,
            version_arrivals=self.arrivals,
            policy_version=policy_version,
        )


class EngineTurns:
    """Model turns of multi-turn episodes in the engine, many in flight, each returned as soon as it
    ends (turns of other episodes keep decoding meanwhile, and the prefix cache serves the episode's
    earlier tokens). `next_id()` numbers requests (with the generates': ids stay unique); `version()`
    is the weights' version as a step runs."""

    def __init__(self, llm: Any, next_id: Callable[[], int], version: Callable[[], int | None]) -> None:
        self.llm = llm
        self.next_id = next_id
        self.version = version
        self._turns: dict[str, TurnDone] = {}  # by engine request id, filled as steps come in
        self._ended: list[TurnDone] = []  # turns that ended in a step no `wait` has returned yet

    @property
    def running(self) -> bool:
        return bool(self._turns)

    def add(self, turns: list[Turn], temperature: float, stop_token_ids: list[int], seed: int | None) -> None:
        """Starts `turns`; they run until `wait` returns them."""
        for turn in turns:
            index = self.next_id()
            params = sampling_params(
                n=1,
                temperature=temperature,
                max_tokens=int(turn.max_tokens),
                stop_token_ids=stop_token_ids,
                seed=None if seed is None else seed + index,
            )
            request_id = f"llamarl-turn-{index}"
            add_prompts(self.llm, [request_id], [turn.prompt_ids], params, [])
            self._turns[request_id] = TurnDone(key=turn.key, token_ids=[], logprobs=[], versions=[])

    def wait(self, max_s: float) -> list[TurnDone]:
        """Steps the engine (at least once, unless turns already ended in steps taken meanwhile) until a
        turn ends or `max_s` passed; returns those that ended."""
        deadline = time.monotonic() + max_s
        while self._turns and not self._ended:
            self.step()
            if time.monotonic() >= deadline:
                break
        done, self._ended = self._ended, []
        return done

    def step(self) -> None:
        """One engine step: each turn's new tokens stamped with the version of the weights that drew them,
        the turns that ended kept for the next `wait` (a weight sync steps the turns while it is pulled)."""
        version = self.version()  # the weights this step's forward pass runs with
        for output in self.llm.llm_engine.step():
            turn = self._turns.get(output.request_id)
            if turn is None:
                continue
            for completion in output.outputs:
                ids, logprobs = _sampled(completion)
                turn.token_ids.extend(ids)
                turn.logprobs.extend(logprobs)
                turn.versions.extend([version] * len(ids))
            if output.finished:
                self._ended.append(self._turns.pop(output.request_id))

    def abort(self) -> None:
        """Abandons every turn still running (and forgets those that ended unreturned)."""
        if self._turns:
            self.llm.llm_engine.abort_request(list(self._turns))
        self._turns = {}
        self._ended = []
