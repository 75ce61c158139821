"""Checkpoints of the whole RL state, written atomically and found again on resume.

A checkpoint is a folder OUTPUT_DIR/checkpoints/step_NNNNNNNN (NNNNNNNN = policy_version) holding:

- the trainer's model and optimizer, through torch.distributed.checkpoint (DCP) with
  `get_state_dict` / `set_state_dict`, saved from every trainer rank over the trainer group: a plain
  module and an FSDP2-sharded one are handled alike, so the checkpoint is sharded when the trainer is;
- `rank{r}.pt` for every rank r: its RNG states (torch CPU and CUDA, Python `random`, NumPy; on a
  generator the torch state is the sampling RNG) and its side's state (each side's `*RankState`, e.g. a
  generator's rollouts made but not yet sent, its samples file length), in format `RANK_STATE_FORMAT`;
- `controller.json`, from the logging rank: the tick to resume at, policy_version, the settings that
  must match, and the run's state (metrics history, evaluation history, W&B run id, lengths of the
  append-only logs: `TrainerRunState`);
- `manifest.json`: every file above with its size and SHA-256;
- `complete`: written last.

Atomicity: everything goes into `step_NNNNNNNN.tmp` first; when every rank has written its part, rank 0
lists the files into the manifest, writes `complete`, fsyncs, and renames the folder to its final name.
A folder without `complete` or whose files do not match the manifest is ignored on resume (the previous
one is used), so a crash at any point of a write never leaves a checkpoint that is half used. Only the
last `keep` complete checkpoints are kept.

Several nodes must share OUTPUT_DIR (the ranks write into the same folder).

`RunCheckpoints` is what a run uses: it finds the checkpoint to resume from (refusing one written with
settings that change which prompts each step sees) and saves every rank's part at the same point; each
side of the run says what its part is (`checkpoint_state`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

CHECKPOINTS_DIR = "checkpoints"
COMPLETE = "complete"
MANIFEST = "manifest.json"
CONTROLLER_STATE = "controller.json"
TRAINER_DIR = "trainer"  # the DCP folder (model + optimizer)
# The format of the sides' states in rank{r}.pt (older ones are read by
# llamarl.control.run.legacy_checkpoints; controller.json kept its keys).
RANK_STATE_FORMAT = 2
_PREFIX = "step_"
_TMP_SUFFIX = ".tmp"


class CheckpointError(RuntimeError):
    """A checkpoint that cannot be written or loaded; the message names the folder."""


@dataclass(frozen=True, kw_only=True)
class Found:
    """A complete, verified checkpoint chosen for resuming."""

    path: Path
    step: int  # the policy_version it holds


def step_dir_name(step: int) -> str:
    return f"{_PREFIX}{step:08d}"


# --------------------------------------------------------------------------------------------------
# RNG states


def capture_rng() -> dict[str, Any]:
    """Every RNG this process draws from: torch (CPU and each CUDA device), Python, NumPy."""
    state: dict[str, Any] = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    try:
        import numpy as np

        state["numpy"] = np.random.get_state()
    except ImportError:  # numpy is optional; nothing of ours draws from it
        pass
    return state


def restore_rng(state: dict[str, Any]) -> None:
    """Puts back what `capture_rng` took, so the next draws are those the saved run made."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
    if "numpy" in state:
        import numpy as np

        np.random.set_state(state["numpy"])


# --------------------------------------------------------------------------------------------------
# writing


class CheckpointWriter:
    """Writes checkpoints of one run. Every rank holds one and calls `save` at the same point.

    Args:
        root: OUTPUT_DIR/checkpoints.
        rank, world_size: this rank in the default process group (every rank writes `rank{r}.pt`).
        keep: how many complete checkpoints to keep (older ones are deleted after each save).
    """

    def __init__(self, root: Path, *, rank: int, world_size: int, keep: int) -> None:
        if keep < 1:
            raise ValueError(f"keep must be at least 1, got {keep}")
        self.root = root
        self.rank = rank
        self.world_size = world_size
        self.keep = keep

    def save(
        self,
        step: int,
        *,
        rank_state: dict[str, Any],
        trainer: tuple[torch.nn.Module, torch.optim.Optimizer] | None,
        trainer_group: dist.ProcessGroup | None,
        controller_state: dict[str, Any] | None,
        before_commit: Callable[[], None] | None = None,
    ) -> Path:
        """Writes checkpoint `step` from this rank; collective over the default group.

        Args:
            rank_state: this rank's own state (RNG states are added here); saved as rank{r}.pt.
            trainer: (model, optimizer) on trainer ranks, None elsewhere; DCP-saved over `trainer_group`.
            controller_state: the run's state, from rank 0 only (JSON-serialisable).
            before_commit: called on every rank after its files are written and before the commit
                (fault injection: a kill there must leave an ignored, incomplete folder).

        Returns the final folder. Raises CheckpointError when this rank cannot write its part (a full
        disk, a folder gone or read-only): the message names the cause and the checkpoint that a resume
        would continue from; the partial folder is removed (it would never be chosen anyway).
        """
        final = self.root / step_dir_name(step)
        tmp = final.with_name(final.name + _TMP_SUFFIX)
        with self._writing(final, tmp):
            if self.rank == 0:
                # A leftover of a write that crashed, or a folder of an older run that reaches this step.
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            dist.barrier()  # nobody writes before the folder is fresh
            if trainer is not None:
                model, optimizer = trainer
                model_sd, optim_sd = get_state_dict(model, optimizer)
                dcp.save(
                    {"model": model_sd, "optim": optim_sd},
                    checkpoint_id=str(tmp / TRAINER_DIR),
                    process_group=trainer_group,
                )
            _atomic_torch_save({**rank_state, "rng": capture_rng()}, tmp / f"rank{self.rank}.pt")
            if controller_state is not None:
                _write_synced(tmp / CONTROLLER_STATE, json.dumps(controller_state).encode())
        if before_commit is not None:
            before_commit()
        with self._writing(final, tmp):
            dist.barrier()  # every rank's part is on disk
            if self.rank == 0:
                self._commit(tmp, final)
                self._prune()
        # Nobody goes on before the commit: a rank that fails right after (its next tick) would have
        # torch elastic stop rank 0 mid-commit, and the checkpoint every rank wrote would be lost.
        dist.barrier()
        return final

    @contextmanager
    def _writing(self, final: Path, tmp: Path) -> Iterator[None]:
        """A write that fails on the file system (a full disk, a folder gone or read-only) becomes a
        CheckpointError naming the cause and the checkpoint a resume would continue from; rank 0
        removes the partial folder (room on a full disk; it would never be chosen anyway)."""
        try:
            yield
        except (Exception, dcp.api.CheckpointException) as e:  # DCP's is a BaseException
            cause = _os_error_in(e) or _full_disk(self.root)
            if cause is None:
                raise
            if self.rank == 0:
                shutil.rmtree(tmp, ignore_errors=True)
            latest = find_latest(self.root)
            resume = f"{latest.path} is the last complete one" if latest else "there is no complete one yet"
            raise CheckpointError(
                f"checkpoint {final} could not be written ({cause.strerror or cause}); {resume}, and "
                "--resume continues from it"
            ) from e

    def _commit(self, tmp: Path, final: Path) -> None:
        expected = [f"rank{r}.pt" for r in range(self.world_size)] + [CONTROLLER_STATE]
        missing = [name for name in expected if not (tmp / name).is_file()]
        if missing or not (tmp / TRAINER_DIR / ".metadata").is_file():
            raise CheckpointError(f"{tmp}: parts missing after every rank wrote: {missing or ['trainer']}")
        manifest = {
            "world_size": self.world_size,
            "files": {
                str(path.relative_to(tmp)): {"bytes": path.stat().st_size, "sha256": _sha256(path)}
                for path in sorted(tmp.rglob("*"))
                if path.is_file()
            },
        }
        _write_synced(tmp / MANIFEST, json.dumps(manifest, indent=1).encode())
        _write_synced(tmp / COMPLETE, b"")
        for folder in {tmp, *(p.parent for p in tmp.rglob("*"))}:
            _fsync_dir(folder)
        shutil.rmtree(final, ignore_errors=True)  # an older run's checkpoint of the same step
        tmp.rename(final)
        _fsync_dir(final.parent)

    def _prune(self) -> None:
        complete = [p for p in _step_dirs(self.root) if (p / COMPLETE).is_file()]
        for path in complete[: -self.keep]:
            shutil.rmtree(path, ignore_errors=True)
        # Incomplete folders (crashed writes) are never used; drop them once a newer one is complete.
        if complete:
            newest = _step_of(complete[-1])
            for path in self.root.glob(f"{_PREFIX}*"):
                if not (path / COMPLETE).is_file() and (_step_of(path) or 0) < newest:
                    shutil.rmtree(path, ignore_errors=True)


# --------------------------------------------------------------------------------------------------
# finding and loading


def verify(path: Path) -> str | None:
    """None when `path` is a complete checkpoint whose files match its manifest, else the reason."""
    if not (path / COMPLETE).is_file():
        return "no 'complete' marker (the write did not finish)"
    try:
        manifest = json.loads((path / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError) as e:
        return f"unreadable manifest ({e})"
    for name, entry in manifest["files"].items():
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if file.stat().st_size != entry["bytes"] or _sha256(file) != entry["sha256"]:
            return f"{name} does not match the manifest"
    return None


def find_latest(root: Path, *, log: Callable[[str], None] | None = None) -> Found | None:
    """The newest complete, verified checkpoint under `root`; newer broken ones are reported and skipped."""
    for path in reversed(_step_dirs(root)):
        reason = verify(path)
        if reason is None:
            return Found(path=path, step=_step_of(path) or 0)
        if log is not None:
            log(f"checkpoint {path} ignored: {reason}")
    return None


def choose_on_rank0(root: Path, *, rank: int, log: Callable[[str], None] | None = None) -> Found | None:
    """Rank 0 picks the checkpoint to resume from and tells every rank (collective)."""
    step = torch.tensor([-1], dtype=torch.int64)
    if rank == 0:
        found = find_latest(root, log=log)
        step[0] = -1 if found is None else found.step
    dist.broadcast(step, 0)
    if int(step) < 0:
        return None
    return Found(path=root / step_dir_name(int(step)), step=int(step))


def load_rank_state(found: Found, rank: int, world_size: int) -> dict[str, Any]:
    """This rank's rank{r}.pt (RNG states under "rng"; restoring them is the caller's choice of when)."""
    manifest = json.loads((found.path / MANIFEST).read_text())
    if manifest["world_size"] != world_size:
        raise CheckpointError(
            f"{found.path} was written by {manifest['world_size']} ranks; this run has {world_size}"
        )
    # weights_only=False: Python's RNG state is a tuple and NumPy's holds an array; the file is ours.
    return torch.load(found.path / f"rank{rank}.pt", weights_only=False)


def load_controller_state(found: Found) -> dict[str, Any]:
    return json.loads((found.path / CONTROLLER_STATE).read_text())


def load_trainer(
    found: Found,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    trainer_group: dist.ProcessGroup | None,
) -> None:
    """Loads model and optimizer in place from the DCP folder (resharded to this trainer's layout)."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd}
    dcp.load(state, checkpoint_id=str(found.path / TRAINER_DIR), process_group=trainer_group)
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def truncate(path: Path, length: int) -> None:
    """Cuts an append-only log back to what it held at the checkpoint (later lines are re-made)."""
    if path.exists() and path.stat().st_size > length:
        with path.open("r+b") as f:
            f.truncate(length)


# --------------------------------------------------------------------------------------------------
# helpers


def _os_error_in(error: BaseException) -> OSError | None:
    """The first OSError behind `error`: itself, what caused it, or (DCP wraps each rank's failure in
    its own exception) one of the failures it carries; torch.save reports a full disk as a RuntimeError
    raised while handling the OSError."""
    seen: set[int] = set()
    stack: list[BaseException] = [error]
    while stack:
        e = stack.pop(0)
        if id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError):
            return e
        failures = getattr(e, "failures", None)  # CheckpointException: {rank: (exception, stack)}
        if isinstance(failures, dict):
            for failure in failures.values():
                inner = failure[0] if isinstance(failure, tuple) and failure else failure
                if isinstance(inner, BaseException):
                    stack.append(inner)
        stack += [c for c in (e.__cause__, e.__context__) if c is not None]
    return None


def _full_disk(path: Path, *, below_bytes: int = 1 << 20) -> OSError | None:
    """ENOSPC when the file system holding `path` has (almost) no room left: torch.save and DCP report
    a short write as a RuntimeError ("unexpected pos") that does not always keep the OSError behind it."""
    try:
        free = shutil.disk_usage(path).free
    except OSError:
        return None
    return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)) if free < below_bytes else None


def _step_of(path: Path) -> int | None:
    digits = path.name[len(_PREFIX) :].removesuffix(_TMP_SUFFIX)
    return int(digits) if digits.isdigit() else None


def _step_dirs(root: Path) -> list[Path]:
    """Final-named (non-.tmp) step folders, oldest first."""
    dirs = [p for p in root.glob(f"{_PREFIX}*") if p.is_dir() and not p.name.endswith(_TMP_SUFFIX)]
    return sorted((p for p in dirs if _step_of(p) is not None), key=lambda p: _step_of(p) or 0)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _write_synced(path: Path, data: bytes) -> None:
    with path.open("wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _atomic_torch_save(obj: Any, path: Path) -> None:
    partial = path.with_name(path.name + ".partial")
    with partial.open("wb") as f:
        torch.save(obj, f)
        f.flush()
        os.fsync(f.fileno())
    partial.rename(path)


def _fsync_dir(path: Path) -> None:
    # A rename or a new file is durable only once its folder is synced.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------------------------------
# a run's checkpoints

# Settings that fix which prompts each tick sees and how they are split: a resumed run must keep them.
MUST_MATCH_ON_RESUME = (
    "task.name",
    "seed",
    "schedule.mode",
    "schedule.prompts_per_step",
    "sampling.samples_per_prompt",
    "ranks.num_generators",
)


@dataclass(frozen=True, kw_only=True)
class Resume:
    """The checkpoint a run continues from, as this rank sees it."""

    found: Found
    tick: int  # the tick (stream mode: the step) to resume at
    policy_version: int
    run_state: dict[str, Any]  # controller.json: the run's state (histories, log lengths)
    rank_state: dict[str, Any]  # this rank's rank{r}.pt (RNG states under "rng")


class RunCheckpoints:
    """The checkpoints of one run in OUTPUT_DIR/checkpoints: `resume()` on start, `save()` when due.

    `settings` maps each of MUST_MATCH_ON_RESUME to this run's value.
    """

    def __init__(self, output_dir: Path, *, rank: int, world_size: int, keep: int, settings: dict[str, Any]):
        self.root = output_dir / CHECKPOINTS_DIR
        self.rank = rank
        self.world_size = world_size
        self.settings = settings
        self.writer = CheckpointWriter(self.root, rank=rank, world_size=world_size, keep=keep)

    def resume(self, log: Callable[[str], None]) -> Resume | None:
        """The latest complete checkpoint, chosen by rank 0 for every rank (collective); None if none.

        Raises CheckpointError when it was written with other settings of MUST_MATCH_ON_RESUME.
        """
        found = choose_on_rank0(self.root, rank=self.rank, log=log)
        if found is None:
            if self.rank == 0:
                log(f"no complete checkpoint in {self.root}: starting from the beginning")
            return None
        run_state = load_controller_state(found)
        for key in MUST_MATCH_ON_RESUME:
            if run_state["settings"][key] != self.settings[key]:
                raise CheckpointError(
                    f"{found.path} was written with {key}={run_state['settings'][key]!r}, "
                    f"this run has {self.settings[key]!r}"
                )
        return Resume(
            found=found,
            tick=run_state["tick"],
            policy_version=run_state["policy_version"],
            run_state=run_state,
            rank_state=load_rank_state(found, self.rank, self.world_size),
        )

    def save(
        self,
        *,
        tick: int,
        policy_version: int,
        rank_state: dict[str, Any],
        run_state: dict[str, Any] | None,
        trainer: tuple[torch.nn.Module, torch.optim.Optimizer] | None,
        trainer_group: dist.ProcessGroup | None,
        before_commit: Callable[[], None] | None = None,
    ) -> Path:
        """Writes checkpoint `policy_version` (collective over every rank). `run_state` comes from rank 0
        only; the tick to resume at and the settings are added to it here, the format to `rank_state`."""
        if run_state is not None:
            run_state = {
                **run_state,
                "tick": tick + 1,
                "policy_version": policy_version,
                "settings": self.settings,
            }
        return self.writer.save(
            policy_version,
            rank_state={**rank_state, "format": RANK_STATE_FORMAT},
            trainer=trainer,
            trainer_group=trainer_group,
            controller_state=run_state,
            before_commit=before_commit,
        )
