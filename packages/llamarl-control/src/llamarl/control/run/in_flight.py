"""A stream request paused part-way: its completions so far, and how they continue.

In stream mode the trainer pauses every generator for a checkpoint or an evaluation. A generator that
is sampling then stops between two decoding steps (`PauseGeneration`) and keeps what it drew
(`GenerationPaused`): `InFlightRequest` holds it, a checkpoint saves it (tokens, behaviour log-probs and
the version of every token), and `resume` continues each unfinished completion from `prompt + what it
drew` (NeMo-RL's and AReaL's partial rollouts) until the request is whole. Nothing sampled is thrown
away and nothing is sampled twice.

A mixture of experts' routes go with the tokens. A continuation forwards the prompt and the tokens drawn
so far again, under the weights it continues with, and those routes are what its later tokens were
computed through: they replace the earlier ones (the row's routes are its newest forward's).

Shape legend: B sequences (num_prompts x G), P prompt length, C completion length, G group size.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.exec.moe.routes import blank_routes
from llamarl.exec.types import GenerationPaused, Generator, RolloutBatch


@dataclass
class _Row:
    """One completion as far as it got (1-D tensors of the tokens drawn)."""

    ids: torch.Tensor  # int64
    logprobs: torch.Tensor  # float32
    versions: torch.Tensor  # int64
    finished: bool
    routes: torch.Tensor | None = None  # stored routes [tokens, L, K] of a mixture of experts


class InFlightRequest:
    """The completions of one request as far as they got; B = num_prompts x G rows in request order."""

    def __init__(self, prompts: RolloutBatch, rows: list[_Row], first_version_B: torch.Tensor) -> None:
        self._prompts = prompts  # prompt_ids_BP, prompt_mask_BP and group_size of the request
        # (a mixture of experts: the prompts' routes, rewritten by each continuation)
        self._prompt_routes_BPLK = (
            None if prompts.prompt_routes_BPLK is None else prompts.prompt_routes_BPLK.clone()
        )
        self._rows = rows
        self._first_version_B = first_version_B  # each row's version at its first token (or at start)

    @classmethod
    def from_paused(cls, paused: GenerationPaused) -> InFlightRequest:
        """The request as `generate` left it when it was paused."""
        batch = paused.partial
        rows = [
            _Row(ids, logprobs, versions, bool(done), routes)
            for (ids, logprobs, versions, routes), done in zip(
                _split(batch), paused.finished_B.tolist(), strict=True
            )
        ]
        return cls(batch, rows, batch.policy_version_B.clone())

    @property
    def unfinished(self) -> list[int]:
        """The rows still to continue."""
        return [r for r, row in enumerate(self._rows) if not row.finished]

    @property
    def num_tokens(self) -> int:
        """Tokens drawn so far over every row."""
        return sum(len(row.ids) for row in self._rows)

    def resume(
        self,
        generator: Generator,
        *,
        max_new_tokens: int,
        between_steps: Callable[[], None] | None,
        greedy: bool = False,
    ) -> RolloutBatch:
        """Continues every unfinished completion; returns the whole request as one batch.

        Rows that drew the same number of tokens continue in one `generate` call (their budget is
        `max_new_tokens` less what they drew), each from its prompt followed by its tokens so far. If
        the continuation is paused again, this request takes what it drew and `GenerationPaused` is
        raised again (call `resume` later). `greedy` as `Generator.generate`'s (tests; training
        samples).
        """
        by_length: dict[int, list[int]] = {}
        for r in self.unfinished:
            by_length.setdefault(len(self._rows[r].ids), []).append(r)
        for drawn, rows in sorted(by_length.items()):
            prompts = [self._prompt(r) + self._rows[r].ids.tolist() for r in rows]
            kwargs = {"between_steps": between_steps} if between_steps is not None else {}
            try:
                more = generator.generate(
                    prompts,
                    samples_per_prompt=1,
                    max_new_tokens=max_new_tokens - drawn,
                    greedy=greedy,
                    **kwargs,
                )
            except GenerationPaused as paused:
                self._extend(rows, paused.partial, paused.finished_B.tolist())
                raise GenerationPaused(self.as_batch(), self.finished_B) from None
            self._extend(rows, more, [True] * len(rows))
        return self.as_batch()

    @property
    def finished_B(self) -> torch.Tensor:
        return torch.tensor([row.finished for row in self._rows], dtype=torch.bool)

    def as_batch(self) -> RolloutBatch:
        """The request as one batch (unfinished rows as far as they got); rewards zeros."""
        length = max((len(row.ids) for row in self._rows), default=0)
        B = len(self._rows)
        ids_BC = torch.zeros(B, length, dtype=torch.int64)
        mask_BC = torch.zeros(B, length, dtype=torch.int64)
        logprobs_BC = torch.zeros(B, length, dtype=torch.float32)
        versions_BC = torch.zeros(B, length, dtype=torch.int64)
        routes_BCLK = None
        if self._prompt_routes_BPLK is not None:
            routes_BCLK = blank_routes(
                B,
                length,
                layers=self._prompt_routes_BPLK.shape[2],
                top_k=self._prompt_routes_BPLK.shape[3],
                dtype=self._prompt_routes_BPLK.dtype,
            )
        for r, row in enumerate(self._rows):
            n = len(row.ids)
            ids_BC[r, :n], logprobs_BC[r, :n], versions_BC[r, :n], mask_BC[r, :n] = (
                row.ids,
                row.logprobs,
                row.versions,
                1,
            )
            if routes_BCLK is not None and row.routes is not None:
                routes_BCLK[r, :n] = row.routes
        return RolloutBatch(
            prompt_ids_BP=self._prompts.prompt_ids_BP,
            prompt_mask_BP=self._prompts.prompt_mask_BP,
            completion_ids_BC=ids_BC,
            completion_mask_BC=mask_BC,
            behavior_logprobs_BC=logprobs_BC,
            rewards_B=torch.zeros(B, dtype=torch.float32),
            policy_version_B=self._first_version_B.clone(),
            token_version_BC=versions_BC,
            group_size=self._prompts.group_size,
            prompt_routes_BPLK=self._prompt_routes_BPLK,
            completion_routes_BCLK=routes_BCLK,
        )

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps (tensors and plain values); `from_state` reads it back."""
        return {"batch": self.as_batch().state(), "finished_B": self.finished_B}

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> InFlightRequest:
        return cls.from_paused(GenerationPaused(RolloutBatch.from_state(state["batch"]), state["finished_B"]))

    def _prompt(self, r: int) -> list[int]:
        mask = self._prompts.prompt_mask_BP[r].bool()
        return self._prompts.prompt_ids_BP[r][mask].tolist()

    def _extend(self, rows: list[int], more: RolloutBatch, finished: list[bool]) -> None:
        """Appends the continuation `more` (one row per entry of `rows`) to those rows."""
        for j, (r, (ids, logprobs, versions, routes), done) in enumerate(
            zip(rows, _split(more), finished, strict=True)
        ):
            row = self._rows[r]
            if len(row.ids) == 0:
                self._first_version_B[r] = more.policy_version_B[j]
            if self._prompt_routes_BPLK is not None and more.has_routes:
                self._take_routes(r, more.prompt_routes_BPLK[j][more.prompt_mask_BP[j].bool()], routes)
            row.ids = torch.cat([row.ids, ids])
            row.logprobs = torch.cat([row.logprobs, logprobs])
            row.versions = torch.cat([row.versions, versions])
            row.finished = done

    def _take_routes(self, r: int, forwarded_TLK: torch.Tensor, new_TLK: torch.Tensor | None) -> None:
        """Row r's routes from its continuation: `forwarded_TLK` its prompt and drawn tokens' (forwarded
        again as the continuation's prompt), `new_TLK` the tokens the continuation drew."""
        assert self._prompt_routes_BPLK is not None and new_TLK is not None
        prompt_mask = self._prompts.prompt_mask_BP[r].bool()
        num_prompt = int(prompt_mask.sum())
        self._prompt_routes_BPLK[r][prompt_mask] = forwarded_TLK[:num_prompt]
        self._rows[r].routes = torch.cat([forwarded_TLK[num_prompt:], new_TLK])


def _split(
    batch: RolloutBatch,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    """Each row's completion as (token ids, behaviour log-probs, versions, stored routes or None),
    padding dropped."""
    rows = []
    assert batch.token_version_BC is not None
    for r in range(batch.num_sequences):
        n = int(batch.completion_mask_BC[r].sum())
        rows.append(
            (
                batch.completion_ids_BC[r, :n].long(),
                batch.behavior_logprobs_BC[r, :n].float(),
                batch.token_version_BC[r, :n].long(),
                None if batch.completion_routes_BCLK is None else batch.completion_routes_BCLK[r, :n],
            )
        )
    return rows
