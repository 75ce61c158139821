"""The vLLM engine's replies as rollouts: a `protocol.GenerateReply` as a RolloutBatch, model turns as
`TurnOutput`s (`EngineTurnSession`, the `TurnSession` of `VLLMGenerator.open_turns`).

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded)
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llamarl.exec.generate.vllm import protocol as p
from llamarl.exec.generate.vllm.client import BETWEEN_STEPS_S, EngineClient
from llamarl.exec.padding import completion_mask, left_pad, right_pad
from llamarl.exec.types import RolloutBatch, TurnOutput


def rollout_batch(
    reply: p.GenerateReply,
    prompts: list[list[int]],
    *,
    samples_per_prompt: int,
    eos_token_ids: list[int],
    pad_token_id: int,
    version_at_start: int,
) -> RolloutBatch:
    """The RolloutBatch of a generate's reply (rewards zeros): token_version_BC the version that sampled
    each token, policy_version_B that of each sequence's first token (`version_at_start` for an empty
    completion)."""
    token_ids, versions = reply.token_ids, reply.token_versions
    num_sequences = len(prompts) * samples_per_prompt
    assert len(token_ids) == num_sequences, (len(token_ids), num_sequences)
    prompt_ids_BP, prompt_mask_BP = left_pad(
        [prompt for prompt in prompts for _ in range(samples_per_prompt)], pad_token_id
    )
    completion_ids_BC = right_pad(token_ids, pad_token_id, torch.int64)
    length = completion_ids_BC.shape[1]
    behavior_logprobs_BC = right_pad(reply.logprobs, 0.0, torch.float32)
    # The engine stamps a token None only if sampled after a failed sync, and then fails the call
    # instead of returning it.
    token_version_BC = right_pad(versions, 0, torch.int64)
    assert behavior_logprobs_BC.shape == token_version_BC.shape == completion_ids_BC.shape
    # vLLM stops at the first EOS and keeps it; the mask also stops at the first EOS, so a padding
    # id equal to EOS (SmolLM2) is never mistaken for a sampled token.
    lengths_B = torch.tensor([len(t) for t in token_ids])
    completion_mask_BC = (torch.arange(length)[None, :] < lengths_B[:, None]).long()
    completion_mask_BC &= completion_mask(completion_ids_BC, eos_token_ids)
    return RolloutBatch(
        prompt_ids_BP=prompt_ids_BP,
        prompt_mask_BP=prompt_mask_BP,
        completion_ids_BC=completion_ids_BC,
        completion_mask_BC=completion_mask_BC,
        behavior_logprobs_BC=behavior_logprobs_BC.masked_fill(completion_mask_BC == 0, 0.0),
        rewards_B=torch.zeros(num_sequences, dtype=torch.float32),
        policy_version_B=torch.tensor(
            [vs[0] if vs else version_at_start for vs in versions], dtype=torch.int64
        ),
        token_version_BC=token_version_BC * completion_mask_BC,
        group_size=samples_per_prompt,
    )


class EngineTurnSession:
    """`TurnSession` over the engine's `TurnsAdd` / `TurnsWait` / `TurnsAbort`: every submitted turn runs
    in the engine, and each is returned as soon as it ends. `between_steps` runs between two waits."""

    def __init__(
        self,
        client: EngineClient,
        *,
        temperature: float,
        eos_token_ids: list[int],
        seed: int | None,
        between_steps: Callable[[], None] | None,
    ) -> None:
        self.client = client
        self.temperature = temperature
        self.eos_token_ids = eos_token_ids
        self.seed = seed
        self.between_steps = between_steps
        self.new: list[p.Turn] = []
        self.running = 0

    def submit(self, key: int, prompt_ids: list[int], max_new_tokens: int) -> None:
        self.new.append(
            p.Turn(key=int(key), prompt_ids=[int(t) for t in prompt_ids], max_tokens=int(max_new_tokens))
        )

    def wait(self) -> list[TurnOutput]:
        if self.new:
            self.client.call(
                p.TurnsAdd(
                    turns=self.new,
                    temperature=self.temperature,
                    stop_token_ids=self.eos_token_ids,
                    seed=self.seed,
                )
            )
            self.running += len(self.new)
            self.new = []
        eos = set(self.eos_token_ids)
        while self.running:
            done: list[p.TurnDone] = self.client.call(p.TurnsWait(max_s=BETWEEN_STEPS_S))
            if done:
                self.running -= len(done)
                return [
                    TurnOutput(
                        key=int(turn.key),
                        token_ids=turn.token_ids,
                        logprobs=turn.logprobs,
                        versions=[int(v) for v in turn.versions],
                        ended=bool(turn.token_ids) and turn.token_ids[-1] in eos,
                    )
                    for turn in done
                ]
            if self.between_steps is not None:
                self.between_steps()
        return []

    def close(self) -> None:
        if self.running or self.new:
            self.new, self.running = [], 0
            self.client.call(p.TurnsAbort())
