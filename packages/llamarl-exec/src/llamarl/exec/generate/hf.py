"""The `hf` generator: batched sampling with transformers' `generate` in this process.

Shape legend:
    B  sequences (num_prompts x samples_per_prompt, the samples of one prompt contiguous)
    P  prompt length (left-padded), C  completion length (right-padded)

How each token is drawn and its behaviour log-prob recorded (plain temperature sampling, nothing of the
model's generation defaults): `llamarl.exec.generate.hf_sampling`. The KV cache it decodes into (each
prompt's computed once for all its samples, each step written in place): `kv_cache`. Its weights and
the syncs that replace them, in place or (in flight) pulled into staging while decoding goes on and
swapped in between two steps: `hf_weights`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from llamarl.comm import WeightSyncEndpoint, WeightSyncGroup
from llamarl.exec.config import LoraConfig, SamplingConfig
from llamarl.exec.generate.hf_routes import GeneratorRoutes
from llamarl.exec.generate.hf_sampling import BehaviorLogprobRecorder, rollout_batch
from llamarl.exec.generate.hf_weights import HFWeights
from llamarl.exec.generate.packed_linear import pack_linear_layers
from llamarl.exec.lora import adapter_tensors, add_lora
from llamarl.exec.models import load_model_and_tokenizer, resolve_dtype
from llamarl.exec.multiturn.episodes import BatchTurnSession
from llamarl.exec.padding import left_pad
from llamarl.exec.train import varlen_attention
from llamarl.exec.types import GenerationPaused, PauseGeneration, RolloutBatch, synced_version

if TYPE_CHECKING:
    from transformers import GenerationConfig


class HFGenerator:
    """Samples completions with a transformers model; implements `llamarl.exec.types.Generator`.

    Attributes:
        model: the policy module; a weight sync writes into its parameters (in place, or in flight into
            a staging copy whose memory they then take: `hf_weights`).
        policy_version: (read-only) the version of the weights in `model`, stamped on every generated
            token: 0 (the checkpoint) from setup, then set by `receive_weights` (in flight: at the swap).
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
        self._policy_version: int | None = 0
        self._weights_written = False  # a sync wrote into `model`: it is no longer the checkpoint
        self.model = None
        self._weights: HFWeights | None = None
        self._decoding = False  # a generate is between two of its steps: a sync taken now is in flight
        self._routes: GeneratorRoutes | None = None  # a mixture of experts: its routes go with the samples

    @property
    def policy_version(self) -> int | None:
        """The version of the weights in `model`; None after a failed sync or `mark_weights_lost`."""
        return self._policy_version

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
        # (routing replay: the trainer scores each token through the experts used here)
        self._routes = GeneratorRoutes(self.model)
        # Decoding multiplies a few rows by every weight at every step: packed once, not per call.
        pack_linear_layers(self.model)
        if self.device == "cpu" and self.model.config._attn_implementation == "sdpa":
            # Decoding steps attend with SDPA's own grouped heads (varlen_attention._decode_attention);
            # everything else stays transformers' SDPA path.
            varlen_attention.register()
            self.model.set_attn_implementation(varlen_attention.VARLEN_ATTENTION)
        self.eos_token_ids, self.pad_token_id = _special_token_ids(
            self.model, self.model_name, self._eos_token_ids, self._pad_token_id
        )
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

    def connect_weight_sync(self, endpoint: WeightSyncEndpoint) -> int:
        """Joins the trainer's weight-sync group as the member `endpoint` describes; syncs then write
        into `model` in place (with LoRA: into its adapters only), and the backend "nccl" receives
        straight into the model on its GPU. The trainer's `WeightSender` must be built at about the same
        time. Returns how many tensors each sync delivers."""
        if self.model is None:
            raise RuntimeError("HFGenerator.connect_weight_sync called before setup()")
        group = WeightSyncGroup(endpoint, device=self.device if endpoint.backend == "nccl" else None)
        try:
            destination = adapter_tensors(self.model) if self.lora is not None else self.model
            self._weights = HFWeights(group, self.model, destination)
        except BaseException:
            group.close()
            raise
        return self._weights.num_tensors

    def receive_weights(self, timeout_s: float) -> int:
        """Waits at most `timeout_s` for the trainer to start a sync, receives it into `model` and adopts
        its policy_version (None while receiving: a failed sync leaves the weights partly replaced).

        Called from a generate's `between_steps` (in flight), it returns at once with the version still
        served: the sync is pulled into staging on a thread while decoding goes on, and swapped in
        between two later steps once whole (at the latest when the generate ends), which is when
        `policy_version` changes and later tokens are stamped with it. A sync that fails in flight
        fails the generate, and leaves the weights served (and their version) as they were."""
        weights = self._weights
        if weights is None:
            raise RuntimeError("HFGenerator.receive_weights called before connect_weight_sync()")
        self._swap_in()  # a sync asked for before this one goes in first
        if self._decoding:
            weights.begin(timeout_s)
            return synced_version(self._policy_version, "the hf generator")
        self._policy_version = None
        self._weights_written = True
        self._policy_version = weights.receive(timeout_s)
        return self._policy_version

    def _swap_in(self, *, if_ready: bool = False) -> None:
        """Swaps a sync pulled in flight in and adopts its version: now (waiting for it), or only once it
        is whole (`if_ready`); nothing when none is pulled. Raises its error if it failed (the weights
        served stay as they were)."""
        weights = self._weights
        if weights is None or not weights.pulling or (if_ready and not weights.ready()):
            return
        self._policy_version = weights.swap()
        self._weights_written = True

    def mark_weights_lost(self) -> None:
        """`policy_version` is None (no generate) until a `receive_weights` succeeds."""
        self._policy_version = None

    def serve_initial_weights(self) -> None:
        """The model still holds the checkpoint it was loaded from: it serves as policy_version 0.
        Raises RuntimeError once a sync wrote into it."""
        if self._weights_written:
            raise RuntimeError("the hf generator's weights came from a weight sync, not its checkpoint")
        self._policy_version = 0

    def restart_engine(self) -> None:
        raise NotImplementedError("the hf generator has no engine process to restart")

    # ----------------------------------------------------------------------------------------------
    # sampling

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

        `prompts`: token ids (chat template applied), no padding; a prompt's completions are contiguous
        in the batch. `greedy`: argmax decoding for evaluation; the log-probs are then those of the
        argmax tokens under softmax(logits / temperature). `between_steps` is called between decoding
        steps (after step t's logits, before step t + 1's forward pass): it may take a sync in flight
        (`receive_weights`: pulled while decoding goes on, swapped in at a later step boundary; later
        tokens come from the new weights, the KV cache of earlier ones is kept), raise to abandon the
        call, or raise `PauseGeneration` to keep what was sampled: `GenerationPaused` then holds it
        (every row has the same number of steps; rows that met EOS are finished).

        Returns a RolloutBatch with rewards zeros, policy_version_B the version at the first token and
        token_version_BC the version that sampled each token.
        """
        if self.model is None:
            raise RuntimeError("HFGenerator.generate called before setup()")
        if not prompts or any(len(p) == 0 for p in prompts):
            raise ValueError("every prompt needs at least one token")
        version_at_start = synced_version(self._policy_version, "the hf generator")
        rows = [p for p in prompts for _ in range(samples_per_prompt)]
        prompt_ids_BP, prompt_mask_BP = left_pad(rows, self.pad_token_id)
        step_versions: list[int] = []  # the policy_version whose logits drew each step's token
        # The recorder draws each sampled token itself from softmax(logits / T), the distribution the
        # behaviour log-probs describe, and hands generate scores whose argmax is that token: generate
        # decodes greedily either way, so none of its samplers touch the tokens.
        on_step = self._on_step(step_versions, between_steps)
        recorder = BehaviorLogprobRecorder(self.sampling.temperature, on_step, draws=not greedy)
        batch = dict(samples_per_prompt=samples_per_prompt, version_at_start=version_at_start)
        try:
            sequences = self._decode(
                prompt_ids_BP, prompt_mask_BP, recorder, samples_per_prompt, max_new_tokens
            )
        except PauseGeneration:
            self._swap_in()  # a sync still pulled goes in now (the trainer is sending it)
            raise self._paused(
                recorder, prompt_ids_BP, prompt_mask_BP, step_versions, max_new_tokens, batch
            ) from None
        self._swap_in()
        completion_ids_BC = sequences[:, prompt_ids_BP.shape[1] :].cpu()
        logprobs_BC = recorder.finish(sequences[:, -1]).cpu()
        return self._batch(
            prompt_ids_BP, prompt_mask_BP, completion_ids_BC, logprobs_BC, step_versions, **batch
        )

    def _on_step(
        self, step_versions: list[int], between_steps: Callable[[], None] | None
    ) -> Callable[[], None]:
        """What runs between two decoding steps: the version that drew this step's token is recorded, a
        sync pulled meanwhile goes in, then `between_steps` runs (a sync it takes is in flight)."""

        def on_step() -> None:
            step_versions.append(synced_version(self._policy_version, "the hf generator"))
            self._swap_in(if_ready=True)  # the next forward pass runs with the sync pulled meanwhile
            if between_steps is not None:
                self._decoding = True
                try:
                    between_steps()
                finally:
                    self._decoding = False

        return on_step

    def _decode(
        self,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor,
        recorder: BehaviorLogprobRecorder,
        samples_per_prompt: int,
        max_new_tokens: int,
    ) -> torch.Tensor:
        """transformers' `generate` over the padded prompts, the recorder as its only logits processor;
        returns prompt + completion ids [B, P + C]."""
        from transformers import LogitsProcessorList

        from llamarl.exec.generate.kv_cache import shared_prompt_cache  # (imports transformers)

        device = self.model.device
        assert self._routes is not None
        with warnings.catch_warnings(), self._routes.recording():
            # Recent transformers name generate's cache argument `cache`; `past_key_values`, the
            # only name older ones know, works until transformers 6 (the dependency's bound).
            warnings.filterwarnings("ignore", "`past_key_values` is deprecated", FutureWarning)
            return self.model.generate(
                input_ids=prompt_ids_BP.to(device),
                attention_mask=prompt_mask_BP.to(device),
                past_key_values=shared_prompt_cache(
                    self.model, prompt_ids_BP, prompt_mask_BP, samples_per_prompt, max_new_tokens
                ),
                generation_config=_generation_config(max_new_tokens, self.eos_token_ids, self.pad_token_id),
                logits_processor=LogitsProcessorList([recorder]),
            )

    def _paused(
        self,
        recorder: BehaviorLogprobRecorder,
        prompt_ids_BP: torch.Tensor,
        prompt_mask_BP: torch.Tensor,
        step_versions: list[int],
        max_new_tokens: int,
        batch: dict[str, Any],
    ) -> GenerationPaused:
        """What a generate paused before step t's token was drawn holds: the t tokens drawn so far,
        resolved (log-probs and versions); step t is drawn again when the completion continues."""
        assert recorder.input_ids is not None
        drawn_BC = recorder.input_ids[:, prompt_ids_BP.shape[1] :].cpu()
        num_drawn = drawn_BC.shape[1]
        logprobs = recorder.logprobs_BC
        logprobs_BC = torch.stack(logprobs, 1).cpu() if logprobs else torch.zeros(drawn_BC.shape[0], 0)
        versions = step_versions[:num_drawn]
        partial = self._batch(
            prompt_ids_BP, prompt_mask_BP, drawn_BC, logprobs_BC, versions, **batch, trim=False
        )
        # A row is done once it drew an EOS (transformers pads it from there on).
        finished_B = torch.isin(drawn_BC, torch.tensor(self.eos_token_ids)).any(1)
        return GenerationPaused(partial, finished_B | (num_drawn >= max_new_tokens))

    def _batch(self, *args: Any, **kwargs: Any) -> RolloutBatch:
        assert self._routes is not None
        batch = rollout_batch(
            *args, eos_token_ids=self.eos_token_ids, pad_token_id=self.pad_token_id, **kwargs
        )
        return self._routes.attach(batch)


def _generation_config(max_new_tokens: int, eos_token_ids: list[int], pad_token_id: int) -> GenerationConfig:
    """Greedy over the recorder's scores, with every other processor of `generate` neutral."""
    from transformers import GenerationConfig

    return GenerationConfig(
        do_sample=False,
        repetition_penalty=1.0,
        no_repeat_ngram_size=0,
        max_new_tokens=max_new_tokens,
        min_length=0,
        num_beams=1,
        eos_token_id=eos_token_ids,
        pad_token_id=pad_token_id,
        use_cache=True,
        return_dict_in_generate=False,
    )


def _special_token_ids(
    model: Any, model_name: str, eos: int | list[int] | None, pad: int | None
) -> tuple[list[int], int]:
    """(eos ids, pad id): the ones given, else the model's generation config's, else its config's; the
    pad id defaults to the first eos id."""
    for source in (model.generation_config, model.config):
        if eos is None:
            eos = source.eos_token_id
        if pad is None:
            pad = source.pad_token_id
    if eos is None:
        raise ValueError(f"{model_name}: the model defines no eos token; set eos_token_ids")
    eos_ids = [eos] if isinstance(eos, int) else list(eos)
    return eos_ids, eos_ids[0] if pad is None else int(pad)
