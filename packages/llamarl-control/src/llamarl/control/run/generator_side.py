"""The generator side of a run: ranks N..N+G-1, each with a `Generator` (transformers in the rank, or a
vLLM engine in a child process), a rule `Rewarder` in worker processes, and a `GeneratorLoop`.

Each generator samples its share of every step's prompts (single-turn completions, or multi-turn episodes
for a task with tools or an environment), scores its own samples, logs every sample
(with the policy version that sampled it) to OUTPUT_DIR/samples.rank{r}.jsonl, and answers its share of
the held-out questions in evaluations. Weights arrive straight from the trainer ranks
(`Generator.receive_weights`: this rank's model, or its engine, joined the weight channel).
"""

from __future__ import annotations

from typing import TextIO

import torch
import torch.distributed as dist

from llamarl.comm import WeightSyncEndpoint
from llamarl.control.launch.devices import generation_dtype
from llamarl.control.run import checkpoint as ckpt
from llamarl.control.run.channels.rollouts import PendingBatch, send_rollouts
from llamarl.control.run.channels.stream import RolloutOutbox, StreamControl
from llamarl.control.run.channels.weights import FIRST_TRAINER_RANK
from llamarl.control.run.generator_loop import GeneratorLoop
from llamarl.control.run.generator_stream import GeneratorStream
from llamarl.control.run.held_out import HeldOutAnswers
from llamarl.control.run.rank_states import GeneratorRankState
from llamarl.control.run.sampler import EpisodeSetup, TaskSampler
from llamarl.control.run.schedule import Tick
from llamarl.control.run.side import Side
from llamarl.control.tasks.prompts import PromptStream, TaskPrompts
from llamarl.exec import HFGenerator, ProcessRewarder, VLLMGenerator
from llamarl.exec.reward.model import build_model_rewarder
from llamarl.exec.types import Generator


class GeneratorSide(Side):
    """A generator rank."""

    side_name = "generators"

    # Built by setup(); None until then, so that close() after a partial setup releases what exists.
    generator: Generator | None = None
    rewarder: ProcessRewarder | None = None
    reward_model = None  # the reward model, when colocated (no reward ranks)
    samples: TextIO | None = None  # OUTPUT_DIR/samples.rank{r}.jsonl
    eval_samples: TextIO | None = None  # OUTPUT_DIR/eval_samples.rank{r}.jsonl
    held_out: HeldOutAnswers | None = None  # this rank's share of every evaluation
    train_prompts: TaskPrompts
    eval_prompts: TaskPrompts
    episodes: EpisodeSetup | None  # a multi-turn task's environments (None: single-turn)
    eval_sampler: TaskSampler
    loop: GeneratorLoop  # built with the channels

    def init_state(self) -> None:
        self.reward_rank = self.config.reward_rank_of(self.rank)  # where this rank's batches go to be scored
        self._pending: PendingBatch | None = None  # async mode: the batch made, not yet sent

    @property
    def generator_index(self) -> int:
        """This rank's index among the generators."""
        return self.rank - self.config.ranks.num_trainers

    def build_executors(self) -> None:
        self.generator = self._build_generator()
        self.generator.setup()
        # One worker by default: answer checking is cheap next to generation, and the cores belong to
        # the model. A task scored only by its environment has no reward functions to run.
        if self.task.reward_functions:
            self.rewarder = ProcessRewarder(self.task.reward_functions, self.config.reward)
            self.rewarder.setup()
        cfg = self.config
        if cfg.reward_model.path is not None and self.reward_rank is None:
            self.reward_model = build_model_rewarder(cfg.reward_model, rank_device=str(self.device))
            self.reward_model.setup()
        self.train_prompts = TaskPrompts(self.task, self.train_examples, self.tokenizer)
        self.eval_prompts = TaskPrompts(self.task, self.eval_examples, self.tokenizer)
        self.episodes = self._episode_setup()
        self.eval_sampler = TaskSampler(
            generator=self.generator,
            rewarder=self.rewarder,
            source=self.eval_prompts,
            sampling=self.config.sampling,
            episodes=self.episodes,
        )

    def _episode_setup(self) -> EpisodeSetup | None:
        """What multi-turn sampling needs, for a task with tools or an environment (else None)."""
        if not self.task.multi_turn:
            return None
        from llamarl.exec.multiturn.episodes import ChatGlue

        return EpisodeSetup(
            new_environment=self.task.new_environment,
            tokenizer=self.tokenizer,
            glue=ChatGlue(self.tokenizer, tools=self.train_prompts.glue_tools()),
        )

    def _build_generator(self) -> Generator:
        cfg = self.config
        # Seeded by its index among the generators, not by its rank: the samples of a run do not change
        # with the number of trainer ranks (a sharded run samples what a single-rank run samples).
        seed = cfg.seed + self.generator_index
        dtype = generation_dtype(cfg.generator.precision, self.device)
        if cfg.generator.backend == "vllm":
            return VLLMGenerator(
                cfg.model,
                cfg.sampling,
                cfg.generator,
                dtype=dtype,
                seed=seed,
                # The engine does this rank's work, so it gets this rank's share of the cores (all of
                # them in sync mode, where ranks take turns); the rank itself only waits on it.
                num_threads=torch.get_num_threads(),
                start_timeout_s=cfg.launch.timeout_s,
                timeout_s=cfg.launch.timeout_s,
                log_path=str(self.output_dir / "logs" / f"vllm_engine.rank{self.rank}.log"),
                device=str(self.device),  # on CUDA the engine gets this rank's GPU alone
                batch_sequences=cfg.request_sequences,
                in_flight_updates=cfg.schedule.mode == "stream",
            )
        return HFGenerator(
            cfg.model, cfg.sampling, device=str(self.device), dtype=dtype, lora=cfg.trainer.lora, seed=seed
        )

    def open_channels(self, endpoint: WeightSyncEndpoint | None) -> None:
        cfg = self.config
        assert endpoint is not None  # a generator rank is a member of the weight channel
        # The generator (or its engine) receives straight from the trainer ranks from now on.
        self.generator.connect_weight_sync(endpoint)
        samples_path = self.output_dir / f"samples.rank{self.rank}.jsonl"
        if self.resumed is not None:  # lines written after the checkpoint are made again, so cut them
            ckpt.truncate(samples_path, GeneratorRankState.from_dict(self.resumed.rank_state).samples_bytes)
        self.samples = samples_path.open("a", encoding="utf-8")
        eval_path = self.output_dir / f"eval_samples.rank{self.rank}.jsonl"
        if self.resumed is not None:
            ckpt.truncate(eval_path, GeneratorRankState.from_dict(self.resumed.rank_state).eval_samples_bytes)
        self.eval_samples = eval_path.open("a", encoding="utf-8")
        self.held_out = HeldOutAnswers(
            task=self.task,
            sampler=self.eval_sampler,
            prompts=self.eval_prompts,
            log=self.eval_samples,
            first=self.generator_index,
            num_generators=cfg.ranks.num_generators,
            samples=cfg.eval.samples,
            heartbeat=self.eval_heartbeat,
        )
        self.loop = GeneratorLoop(
            generator=self.generator,
            rewarder=self.rewarder,
            prompts=PromptStream(
                self.prompt_order,
                prompts_per_step=cfg.schedule.prompts_per_step,
                generator_index=self.generator_index,
                num_generators=cfg.ranks.num_generators,
            ),
            source=self.train_prompts,
            sampling=cfg.sampling,
            schedule=cfg.schedule,
            weights_timeout_s=cfg.launch.timeout_s,
            timeline=self.timeline,
            sample_log=self.samples,
            before_request=self._strike_at_request,
            trainer_waiting=self.borrow_cores,
            replace_engines=cfg.replaces_engines,
            episodes=self.episodes,
            reward_model=self.reward_model,
            reward_model_config=cfg.reward_model,
        )

    def _strike_at_request(self, request: int) -> None:
        """Stream mode's fault points: this rank at the start of its request N, or its engine during it."""
        self.faults.strike(request)
        self.faults.strike(request, "request", engine_pid=lambda: self.generator.engine_pid)

    def restore(self, resume: ckpt.Resume) -> None:
        mine = GeneratorRankState.from_dict(resume.rank_state)
        self.loop.prompts.position = mine.prompt_position
        if mine.work is not None:
            self.loop.work.restore(mine.work)
        self._pending = mine.pending
        # The generator's cumulative counters continue from the checkpoint (the trainer takes their
        # differences per step).
        self.loop.restore_totals(mine.generator_totals)

    def checkpoint_state(self) -> GeneratorRankState:
        self.samples.flush()
        self.eval_samples.flush()
        return GeneratorRankState(
            prompt_position=self.loop.prompts.position,
            generator_totals=self.loop.metrics(),
            samples_bytes=self.samples.tell(),
            eval_samples_bytes=self.eval_samples.tell(),
            pending=self._pending,
            work=self.loop.work.state(),
        )

    # ----------------------------------------------------------------------------------------------
    # lock step

    def generate(self, tick: Tick) -> None:
        self._pending = self.loop.make_batch(tick.index)
        if self.reward_rank is not None:
            # Handed to the reward rank now, not at the next move: it scores while this rank goes on
            # (async: while the trainer trains and this rank samples the next batch).
            self._pending.send(dst=self.reward_rank)
            self._pending = None

    def move_rollouts(self, tick: Tick) -> None:
        if self.reward_rank is not None:
            return  # the reward rank forwards the batch it scored
        assert self._pending is not None, "no batch to send"
        self._pending.send(dst=FIRST_TRAINER_RANK)
        self._pending = None

    def sync_weights(self) -> None:
        self.loop.tick = self.tick
        self.loop.receive_weights()

    def after_resume(self) -> None:
        # A checkpoint of an async run's last tick holds no rollouts in flight; a longer run needs them,
        # so they are made now (by the restored policy: lag 0 for that one batch).
        cfg = self.config
        if not (cfg.schedule.mode == "async" and 0 < self.start_tick <= cfg.schedule.steps):
            return
        if self.reward_rank is not None:
            # The batch in flight, if any, waits on the reward rank, which says whether it has one.
            held = torch.zeros(1, dtype=torch.int64)
            dist.recv(held, self.reward_rank)
            if not int(held):
                with self.borrow_cores():
                    batch = self.loop.make_batch(self.start_tick - 1)
                batch.send(dst=self.reward_rank)
        elif self._pending is None:
            with self.borrow_cores():  # the trainer's first tick waits for this batch
                self._pending = self.loop.make_batch(self.start_tick - 1)

    # ----------------------------------------------------------------------------------------------
    # stream

    def run_stream(self) -> None:
        """Samples back to back and sends groups to the first trainer rank's buffer until it stops the
        run (`llamarl.control.run.generator_stream`)."""
        # To the trainer's buffer, through this rank's reward rank if there are reward ranks.
        dst = FIRST_TRAINER_RANK if self.reward_rank is None else self.reward_rank
        outbox = RolloutOutbox(
            lambda batch, metrics: send_rollouts(batch, metrics, dst=dst, group=self.rollout_group),
            timeout_s=self.config.launch.timeout_s,
        )
        GeneratorStream(
            self.loop,
            StreamControl(self.store),
            outbox,
            in_flight=self.generator.supports_in_flight_updates,
            on_pause=self.in_stream_pause,
        ).run()

    # ----------------------------------------------------------------------------------------------
    # evaluation

    def score_evaluation(self, scores_4Q: torch.Tensor, version: torch.Tensor, when: str) -> None:
        version[0] = self.loop.policy_version
        assert self.held_out is not None
        with self.borrow_cores():  # the trainer waits meanwhile
            self.held_out.score(scores_4Q, when=when, policy_version=self.loop.policy_version)

    def close(self) -> None:
        for part in (self.rewarder, self.reward_model, self.generator, self.samples, self.eval_samples):
            if part is not None:
                part.close()
