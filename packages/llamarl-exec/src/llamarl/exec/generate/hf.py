"""The `hf` generator: batched sampling with transformers' `generate`, recording behaviour log-probs.

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded), V  vocabulary size

The behaviour log-probs must be those of the distribution the tokens were actually sampled from,
log softmax(logits / temperature), because AIPO divides by them. So sampling is pinned to plain
temperature sampling (top-k, top-p, min-p, repetition penalties and the model's own generation defaults
all switched off): a logits processor draws each token itself from that distribution and records its
log-prob during `generate` (which then decodes greedily over the processor's scores), holding one B x V
float32 step at a time rather than every step's logits (B x C x V).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from llamarl.comm import DEAD_AFTER_S, WeightReceiver, WeightSyncGroup
from llamarl.exec.config import LoraConfig, SamplingConfig
from llamarl.exec.generate.packed_linear import pack_linear_layers, weights_changed
from llamarl.exec.lora import adapter_tensors, add_lora
from llamarl.exec.models import load_model_and_tokenizer, resolve_dtype
from llamarl.exec.multiturn.episodes import BatchTurnSession
from llamarl.exec.padding import completion_mask, left_pad
from llamarl.exec.train import varlen_attention
from llamarl.exec.types import GenerationPaused, PauseGeneration, RolloutBatch

if TYPE_CHECKING:
    from transformers import Cache


def draw_tokens(scaled_BV: torch.Tensor, block: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from softmax(scaled_BV) (float [B, V], the logits over the temperature), and
    its log-probability: (int64 [B], float [B]).

    By the inverse of the cumulative distribution, one uniform number per row, in two levels: the
    row's blocks of `block` entries first, then the entries of the block drawn. transformers'
    `torch.multinomial` draws an exponential variate per vocabulary entry (24 ms a step for 16 x 49k on
    one CPU thread); a log-softmax, its exp and a cumulative sum over the whole row took 3.7 ms, this
    1.0 ms. The random numbers come from torch's global generator (seeded by `HFGenerator.setup`).
    `scaled_BV` is overwritten (with exp(scaled - row max)): a fresh B x V tensor a step costs more than
    the exp (1.3 ms for 16 x 49k beside the decoding, whose weights leave it no cache).
    """
    num_rows, vocab = scaled_BV.shape
    max_B1 = scaled_BV.amax(-1, keepdim=True)
    weights_BV = scaled_BV.sub_(max_B1).exp_()  # probabilities up to the row's sum, in [0, 1]
    if vocab % block:
        weights_BV = torch.nn.functional.pad(weights_BV, (0, block - vocab % block))
    weights_BNK = weights_BV.view(num_rows, -1, block)
    cdf_BN = weights_BNK.sum(-1).cumsum(-1)
    total_B1 = cdf_BN[:, -1:]
    if not torch.isfinite(total_B1).all():  # (torch.multinomial refuses these too)
        raise ValueError("cannot sample: the model's logits hold NaN or infinite values")
    u_B1 = torch.rand(num_rows, 1, device=scaled_BV.device, dtype=cdf_BN.dtype) * total_B1
    # The first block, then entry, whose cumulative weight exceeds u: one of zero weight never does.
    block_B = torch.searchsorted(cdf_BN, u_B1, right=True).squeeze(-1).clamp_(max=cdf_BN.shape[1] - 1)
    rows_B = torch.arange(num_rows, device=scaled_BV.device)
    cdf_BK = weights_BNK[rows_B, block_B].cumsum(-1)
    before_B = torch.where(block_B > 0, cdf_BN[rows_B, block_B - 1], 0.0)
    # u's place within its block, as a fraction of the block's weight, so that rounding (the block sum
    # against its cumulative sum) can never carry it past the block's last entry of nonzero weight.
    fraction_B = ((u_B1[:, 0] - before_B) / (cdf_BN[rows_B, block_B] - before_B)).clamp_(0.0, 1.0 - 1e-6)
    within_B1 = (fraction_B * cdf_BK[:, -1])[:, None]
    entry_B = torch.searchsorted(cdf_BK, within_B1, right=True).squeeze(-1).clamp_(max=block - 1)
    token_B = block_B * block + entry_B
    logprob_B = weights_BV[rows_B, token_B].log() - total_B1[:, 0].log()  # (a drawn weight is > 0)
    return token_B, logprob_B


class _BehaviorLogprobRecorder:
    """Logits processor that records log softmax(scores / T)[sampled token] at every decoding step.

    `generate` calls it with the scores of step t before the token of step t is drawn; that token shows
    up as the last column of `input_ids` at step t + 1, so the previous step's log-softmax is kept until
    then and the last step is resolved by `finish()`. It returns the scores unchanged, or with `draws`
    it draws the token itself (`draw_tokens`) and returns scores whose argmax is that token (a one-hot).
    """

    def __init__(
        self, temperature: float, on_step: Callable[[], None] | None = None, *, draws: bool = False
    ) -> None:
        self.temperature = temperature
        self.draws = draws  # sample the token here (generate then runs greedy over the returned scores)
        self.on_step = on_step  # called once per decoding step, after that step's scores are recorded
        self.logprobs_BC: list[torch.Tensor] = []
        self.input_ids: torch.Tensor | None = None  # prompt + every token drawn so far (a paused call's)
        # The last step's log-probs, resolved once its token is known: [B, V] (all) when generate picks
        # the token, [B] (the drawn token's) when this draws it.
        self._pending: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self.input_ids = input_ids
        if self._pending is not None:
            self._resolve(input_ids[:, -1])
        scaled_BV = scores.float()
        if self.temperature != 1.0:  # (a division of B x 49k floats a step saved at the usual T = 1)
            scaled_BV = scaled_BV / self.temperature
        if not self.draws:
            self._pending = torch.log_softmax(scaled_BV, dim=-1)  # [B, V]: the token comes from generate
        if self.on_step is not None:
            self.on_step()
        if not self.draws:
            return scores
        # [B]: the drawn token's log-prob. (scaled_BV is spent: generate keeps no scores.)
        token_B, self._pending = draw_tokens(scaled_BV)
        # generate only takes the argmax of what this returns: a one-hot of bytes is a quarter of
        # the float scores to fill and scan (1.1 -> 0.4 ms a step for 16 x 49k on one thread).
        one_hot_BV = torch.zeros(scores.shape, dtype=torch.uint8, device=scores.device)
        return one_hot_BV.scatter_(-1, token_B[:, None], 1)

    def _resolve(self, token_ids_B: torch.Tensor) -> None:
        """Records the pending step's log-probs of `token_ids_B`, the tokens generate appended (a row that
        had finished gets padding there: its log-prob is masked out later, whatever it is)."""
        assert self._pending is not None
        pending = self._pending
        if pending.dim() == 2:
            pending = pending.gather(-1, token_ids_B[:, None]).squeeze(-1)
        self.logprobs_BC.append(pending)
        self._pending = None

    def finish(self, last_token_ids_B: torch.Tensor) -> torch.Tensor:
        """Resolves the last step; returns the float32 log-probs of every generated position [B, C]."""
        if self._pending is not None:
            self._resolve(last_token_ids_B)
        if not self.logprobs_BC:
            return torch.zeros(last_token_ids_B.shape[0], 0)
        return torch.stack(self.logprobs_BC, dim=1)


class HFGenerator:
    """Samples completions with a transformers model; implements `llamarl.exec.types.Generator`.

    Attributes:
        model: the policy module; weight sync writes into its parameters in place.
        policy_version: the version of the weights in `model`; set by `receive_weights` (or by the caller
            after a sync) and stamped on every generated token.
    """

    # `generate` takes `between_steps`: stream mode loads new weights between decoding steps.
    supports_in_flight_updates = True
    # No engine process: nothing to restart or kill (see the Generator Protocol).
    can_restart_engine = False
    engine_pid = None

    def __init__(
        self,
        model: str,
        sampling: SamplingConfig,
        *,
        device: str = "cpu",
        dtype: str = "float32",
        lora: LoraConfig | None = None,
        seed: int | None = None,
        eos_token_ids: list[int] | None = None,
        pad_token_id: int | None = None,
    ) -> None:
        """`model`: hub id or local folder of the policy. `dtype`: weights and compute ("bfloat16" where
        the device has it). `lora`: the trainer's LoRA settings; with a rank > 0 the model gets the same
        adapters (in `dtype`) and weight syncs carry only them. `seed` seeds torch's RNG in setup() so
        sampling is reproducible. `eos_token_ids` end a completion (default: the model's eos ids);
        `pad_token_id` pads (default: the model's, else the first eos id)."""
        self.model_name = model
        self.sampling = sampling
        self.device = device
        self.dtype = dtype
        self.lora = lora if lora is not None and lora.rank else None
        self.seed = seed
        self._eos_token_ids = eos_token_ids
        self._pad_token_id = pad_token_id
        self.policy_version: int | None = 0
        self.model = None
        self._weights: WeightReceiver | None = None

    def setup(self) -> None:
        """Loads the model onto the device."""
        if self.seed is not None:
            torch.manual_seed(self.seed)
        self.model, _ = load_model_and_tokenizer(
            self.model_name, dtype=self.dtype, device=self.device, with_tokenizer=False
        )
        if self.lora is not None:
            # Unmerged adapters (lora_B starts at 0): the same modules as the trainer's, so a sync of the
            # adapters alone makes this model compute what the trainer's does.
            add_lora(self.model, self.lora, dtype=resolve_dtype(self.dtype))
        self.model.eval()
        self.model.requires_grad_(False)  # never trained here; lets weight sync copy without autograd
        # Decoding multiplies a few rows by every weight at every step: packed once, not per call.
        pack_linear_layers(self.model)
        if self.device == "cpu" and self.model.config._attn_implementation == "sdpa":
            # Decoding steps attend with SDPA's own grouped heads (varlen_attention._decode_attention);
            # everything else stays transformers' SDPA path.
            varlen_attention.register()
            self.model.set_attn_implementation(varlen_attention.VARLEN_ATTENTION)
        eos = self._eos_token_ids
        if eos is None:
            eos = self.model.generation_config.eos_token_id
        if eos is None:
            eos = self.model.config.eos_token_id
        if eos is None:
            raise ValueError(f"{self.model_name}: the model defines no eos token; set eos_token_ids")
        self.eos_token_ids = [eos] if isinstance(eos, int) else list(eos)
        pad = self._pad_token_id
        if pad is None:
            pad = self.model.generation_config.pad_token_id
        if pad is None:
            pad = self.model.config.pad_token_id
        self.pad_token_id = self.eos_token_ids[0] if pad is None else int(pad)
        # None of the model's generation defaults (its generation_config.json: top_k, min_new_tokens...)
        # may reach generate, which fills what a call leaves unset from them; `generate` sets what it
        # needs. (min_new_tokens=0 in the call instead would make min_length the prompt's length and
        # add a processor that copies the B x V scores at every step for nothing.)
        from transformers import GenerationConfig

        self.model.generation_config = GenerationConfig()

    def close(self) -> None:
        """Leaves the weight-sync group and drops the model (and its device memory)."""
        if self._weights is not None:
            self._weights.close()
            self._weights.group.close()
            self._weights = None
        self.model = None

    # ----------------------------------------------------------------------------------------------
    # weights

    def connect_weight_sync(
        self,
        *,
        host: str,
        port: int,
        rank: int,
        world_size: int,
        timeout_s: float,
        dead_after_s: float = DEAD_AFTER_S,
        src_rank: int = 0,
        backend: str = "gloo",
    ) -> None:
        """Joins the trainer's weight-sync group as `rank`; syncs then write into `model` in place (with
        LoRA: into its adapters only). The trainer's `WeightSender` must be built at about the same time.
        `timeout_s` bounds each step of a sync (forming the group, every bucket), `dead_after_s` a wait
        for a trainer rank whose heartbeat stood still. `backend` "nccl" receives straight into the
        model on its GPU."""
        if self.model is None:
            raise RuntimeError("HFGenerator.connect_weight_sync called before setup()")
        group = WeightSyncGroup(
            host=host,
            port=port,
            rank=rank,
            world_size=world_size,
            timeout_s=timeout_s,
            dead_after_s=dead_after_s,
            backend=backend,
            device=self.device if backend == "nccl" else None,
        )
        try:
            destination = adapter_tensors(self.model) if self.lora is not None else self.model
            self._weights = WeightReceiver(group, destination, src_rank=src_rank)
        except BaseException:
            group.close()
            raise

    def receive_weights(self, timeout_s: float) -> int:
        """Waits at most `timeout_s` for the trainer to start a sync, receives it into `model` and adopts
        its policy_version (None while receiving: a failed sync leaves the weights partly replaced)."""
        if self._weights is None:
            raise RuntimeError("HFGenerator.receive_weights called before connect_weight_sync()")
        self.policy_version = None
        try:
            self.policy_version = self._weights.receive(timeout_s)
        finally:  # (written through `.data`, which the packed layers cannot see; also a partial write)
            weights_changed(self.model)
        return self.policy_version

    def restart_engine(self) -> None:
        raise NotImplementedError("the hf generator has no engine process to restart")

    def open_turns(
        self, *, greedy: bool = False, between_steps: Callable[[], None] | None = None
    ) -> BatchTurnSession:
        """Model turns of multi-turn episodes: each wait samples the pending turns in one `generate`
        (in-flight updates through `between_steps` as there)."""
        if self.model is None:
            raise RuntimeError("HFGenerator.open_turns called before setup()")
        return BatchTurnSession(
            self, eos_token_ids=self.eos_token_ids, greedy=greedy, between_steps=between_steps
        )

    # no_grad, not inference_mode: the batch's tensors may go straight into a trainer in the same
    # process, and inference tensors cannot be saved for backward there.
    @torch.no_grad()
    def generate(
        self,
        prompts: list[list[int]],
        *,
        samples_per_prompt: int,
        max_new_tokens: int,
        greedy: bool = False,
        between_steps: Callable[[], None] | None = None,
    ) -> RolloutBatch:
        """Samples `samples_per_prompt` completions of every prompt in one batched `generate` call.

        Args:
            prompts: token ids of each prompt (chat template already applied), no padding.
            samples_per_prompt: completions per prompt; they are contiguous in the batch.
            max_new_tokens: completion length limit (a completion that hits it has no EOS).
            greedy: argmax decoding for evaluation; the log-probs are then those of the argmax tokens
                under softmax(logits / temperature).
            between_steps: called between decoding steps (after step t's logits, before step t + 1's
                forward pass). It may load new weights into `model` in place and raise
                `policy_version` (an in-flight update: later tokens come from the new weights; the
                KV cache of earlier tokens is kept), or raise to abandon the call; `PauseGeneration`
                keeps what was sampled (`GenerationPaused`).

        Returns:
            RolloutBatch with rewards zeros, policy_version_B = the version at the first token and
            token_version_BC = the version that sampled each token.

        Raises:
            GenerationPaused: `between_steps` raised `PauseGeneration`; it holds the completions drawn
                so far (every row has the same number of steps; rows that met EOS are finished).
        """
        if self.model is None:
            raise RuntimeError("HFGenerator.generate called before setup()")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        from transformers import GenerationConfig, LogitsProcessorList

        device = self.model.device
        prompt_ids_BP, prompt_mask_BP = left_pad(
            [p for p in prompts for _ in range(samples_per_prompt)], self.pad_token_id
        )
        step_versions: list[int] = []  # the policy_version whose logits drew each step's token

        def on_step() -> None:
            step_versions.append(self.policy_version)
            if between_steps is not None:
                between_steps()

        # The recorder draws each sampled token itself from softmax(logits / T) (`draw_tokens`), the
        # distribution the behaviour log-probs describe, and hands generate scores whose argmax is that
        # token: generate decodes greedily either way, so none of its samplers (nor the model's
        # generation_config.json defaults, e.g. top_k=50, top_p=0.9) touch the tokens.
        recorder = _BehaviorLogprobRecorder(self.sampling.temperature, on_step, draws=not greedy)
        generation_config = GenerationConfig(
            do_sample=False,
            repetition_penalty=1.0,
            no_repeat_ngram_size=0,
            max_new_tokens=max_new_tokens,
            min_length=0,
            num_beams=1,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            use_cache=True,
            return_dict_in_generate=False,
        )
        try:
            with warnings.catch_warnings():
                # Recent transformers name generate's cache argument `cache`; `past_key_values`, the
                # only name older ones know, works until transformers 6 (the dependency's bound).
                warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
                sequences = self.model.generate(
                    input_ids=prompt_ids_BP.to(device),
                    attention_mask=prompt_mask_BP.to(device),
                    past_key_values=self._kv_cache(
                        prompt_ids_BP, prompt_mask_BP, samples_per_prompt, max_new_tokens
                    ),
                    generation_config=generation_config,
                    logits_processor=LogitsProcessorList([recorder]),
                )
        except PauseGeneration:
            # Paused before step t's token was drawn: the t tokens drawn so far are resolved (log-probs
            # and versions); step t is drawn again when the completion continues.
            assert recorder.input_ids is not None
            drawn_BC = recorder.input_ids[:, prompt_ids_BP.shape[1] :].cpu()
            num_drawn = drawn_BC.shape[1]
            logprobs = recorder.logprobs_BC
            logprobs_BC = torch.stack(logprobs, 1) if logprobs else torch.zeros(drawn_BC.shape[0], 0)
            partial = self._batch(
                prompt_ids_BP,
                prompt_mask_BP,
                drawn_BC,
                logprobs_BC.cpu(),
                step_versions[:num_drawn],
                samples_per_prompt,
                trim=False,
            )
            # A row is done once it drew an EOS (transformers pads it from there on).
            finished_B = torch.isin(drawn_BC, torch.tensor(self.eos_token_ids)).any(1)
            raise GenerationPaused(partial, finished_B | (num_drawn >= max_new_tokens)) from None
        return self._batch(
            prompt_ids_BP,
            prompt_mask_BP,
            sequences[:, prompt_ids_BP.shape[1] :].cpu(),
            recorder.finish(sequences[:, -1]).cpu(),
            step_versions,
            samples_per_prompt,
        )

    def _kv_cache(
        self,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor,
        samples_per_prompt: int,
        max_new_tokens: int,
    ) -> Cache | None:
        """The KV cache `generate` decodes into: every prompt's tokens but its last, computed once per
        prompt and repeated for its samples (rows are a prompt's samples, contiguous), with room
        reserved for the whole generation (`llamarl.exec.generate.kv_cache`, each step written in place).
        `generate` then forwards only the last prompt token of each row before it decodes. None
        (generate builds its own) for one-token prompts.

        Without the sharing each prompt is forwarded once per sample: for GSM8K's 4 prompts x 4 samples
        x 128 new tokens, 1536 prompt positions (padded) beside 2048 decoded tokens, instead of 380.
        Positions follow the attention mask as `generate`'s own (cumulative sum of the mask minus one,
        padding at 1), so the cache is the one it would build.
        """
        from llamarl.exec.generate.kv_cache import reserve  # (imports transformers: only where it is used)

        if prompt_ids_BP.shape[1] < 2:
            return None
        device = self.model.device
        ids_GP = prompt_ids_BP[::samples_per_prompt, :-1].to(device)
        mask_GP = prompt_mask_BP[::samples_per_prompt, :-1].to(device)
        positions_GP = (mask_GP.long().cumsum(-1) - 1).masked_fill_(mask_GP == 0, 1)
        cache = self.model(
            input_ids=ids_GP, attention_mask=mask_GP, position_ids=positions_GP, use_cache=True
        ).past_key_values
        if samples_per_prompt > 1:
            cache.batch_repeat_interleave(samples_per_prompt)
        return reserve(cache, capacity=prompt_ids_BP.shape[1] + max_new_tokens)

    def _batch(
        self,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor,
        completion_ids_BC: torch.Tensor,
        behavior_logprobs_BC: torch.Tensor,
        step_versions: list[int],
        samples_per_prompt: int,
        *,
        trim: bool = True,
    ) -> RolloutBatch:
        """The RolloutBatch of `generate`'s raw output: completions masked after their first EOS and
        (with `trim`) cut to the longest; `step_versions[t]` sampled every row's token t."""
        completion_mask_BC = completion_mask(completion_ids_BC, self.eos_token_ids)
        # Columns past the longest completion hold only padding (possible when max_new_tokens is hit
        # by none): drop them so C is the longest completion.
        if trim:
            length = int(completion_mask_BC.sum(1).max()) if completion_mask_BC.numel() else 0
        else:
            length = completion_ids_BC.shape[1]
        completion_ids_BC = completion_ids_BC[:, :length]
        completion_mask_BC = completion_mask_BC[:, :length]
        completion_ids_BC = completion_ids_BC.masked_fill(completion_mask_BC == 0, self.pad_token_id)
        # masked_fill, not a product: a padding position may hold -inf, and -inf * 0 is nan.
        behavior_logprobs_BC = (
            behavior_logprobs_BC[:, :length].float().masked_fill(completion_mask_BC == 0, 0.0)
        )

        num_sequences = prompt_ids_BP.shape[0]
        versions_C = torch.tensor(step_versions[:length], dtype=torch.int64).reshape(1, length)
        token_version_BC = versions_C.expand(num_sequences, length) * completion_mask_BC
        first_version = step_versions[0] if step_versions else self.policy_version
        return RolloutBatch(
            prompt_ids_BP=prompt_ids_BP,
            prompt_mask_BP=prompt_mask_BP,
            completion_ids_BC=completion_ids_BC.long(),
            completion_mask_BC=completion_mask_BC,
            behavior_logprobs_BC=behavior_logprobs_BC,
            rewards_B=torch.zeros(num_sequences, dtype=torch.float32),
            policy_version_B=torch.full((num_sequences,), first_version, dtype=torch.int64),
            token_version_BC=token_version_BC,
            group_size=samples_per_prompt,
        )
