"""The vLLM engine's settings on CUDA and on the CPU, proven without a GPU: which interpreter runs the
engine, which environment its process gets (its own CUDA_VISIBLE_DEVICES), and which keyword arguments
its `vllm.LLM` is built with (checked against the real vLLM's own argument list)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from llamarl.exec.config import GeneratorConfig, SamplingConfig
from llamarl.exec.generate.vllm.env import VLLMEnvironmentError, engine_env, find_vllm_python, visible_device
from llamarl.exec.generate.vllm.generator import VLLMGenerator
from llamarl.exec.generate.vllm.server import llm_kwargs, parse_args
from llamarl.exec.testing import vllm_python_for_tests

EXTENSION = "llamarl.comm.adapters.vllm.WeightSyncWorkerExtension"


def built_with(generator: VLLMGenerator) -> dict:
    """The kwargs the engine process builds its vllm.LLM with, from the generator's server flags."""
    return llm_kwargs(parse_args(["--fd", "3", *generator.server_args()]), worker_extension_cls=EXTENSION)


# SmolLM2-135M's shapes: 30 layers of 3 KV heads of 64, bf16 keys and values: 23,040 bytes a token.
MODEL_CONFIG = {
    "num_hidden_layers": 30, "num_attention_heads": 9, "num_key_value_heads": 3, "hidden_size": 576,
    "max_position_embeddings": 8192,
}  # fmt: skip


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("model")
    (path / "config.json").write_text(json.dumps(MODEL_CONFIG))
    return path


@pytest.fixture
def generator(model_dir):
    """`generator(device, in_flight=False, **engine)`: a VLLMGenerator (not started) of 512-sequence
    requests of 128 new tokens."""

    def make(device: str, *, in_flight: bool = False, **engine) -> VLLMGenerator:
        return _generator(model_dir, device, in_flight=in_flight, **engine)

    return make


def _generator(model_dir, device: str, *, in_flight: bool = False, **engine) -> VLLMGenerator:
    return VLLMGenerator(
        str(model_dir),
        SamplingConfig(max_new_tokens=128),
        GeneratorConfig(backend="vllm", **engine),
        device=device,
        dtype="bfloat16" if device.startswith("cuda") else "float32",
        batch_sequences=512,
        in_flight_updates=in_flight,
    )


def test_on_cuda_the_engine_captures_cuda_graphs_schedules_async_and_takes_its_share_of_the_gpu(generator):
    kwargs = built_with(generator("cuda:1", gpu_memory_utilization=0.4))
    assert kwargs["enforce_eager"] is False  # CUDA graphs
    assert kwargs["async_scheduling"] is True  # lock-step modes: no weights load mid-generate
    assert kwargs["gpu_memory_utilization"] == 0.4  # not vLLM's default 90%
    assert kwargs["max_num_seqs"] == 512  # sized to one request (the GPU recipe's 64 prompts x 8)
    assert kwargs["dtype"] == "bfloat16" and kwargs["logprobs_mode"] == "processed_logprobs"
    assert kwargs["worker_extension_cls"] == EXTENSION


def test_in_flight_updates_turn_async_scheduling_off_and_settings_come_from_the_config(generator):
    # Stream mode loads weights between two engine steps: a step scheduled ahead would run on the new
    # weights with its tokens stamped as the old version.
    assert built_with(generator("cuda:0", in_flight=True))["async_scheduling"] is False
    kwargs = built_with(
        generator("cuda:0", cuda_graphs=False, async_scheduling=False, max_num_seqs=96, max_model_len=1024)
    )
    assert kwargs["enforce_eager"] is True and kwargs["async_scheduling"] is False
    assert kwargs["max_num_seqs"] == 96 and kwargs["max_model_len"] == 1024


def test_on_the_cpu_the_engine_runs_eager_without_a_gpu_share(generator):
    kwargs = built_with(generator("cpu"))
    assert kwargs["enforce_eager"] is True and kwargs["async_scheduling"] is False
    assert "gpu_memory_utilization" not in kwargs
    assert "kv_cache_memory_bytes" not in built_with(generator("cuda:0"))  # the GPU share holds it


def test_the_cpu_engines_kv_cache_is_sized_for_the_run_unless_set(generator):
    per_token = 2 * 30 * 3 * 64 * 4  # float32 keys and values (the CPU generator here computes in fp32)
    # 512 sequences of a 1024-token prompt allowance and 128 new tokens, 10% over.
    assert built_with(generator("cpu"))["kv_cache_memory_bytes"] == int(512 * (1024 + 128) * per_token * 1.1)
    # A small request still holds one sequence of the engine's longest, which vLLM requires to start.
    small = built_with(generator("cpu", max_num_seqs=2))["kv_cache_memory_bytes"]
    assert small == int(8192 * per_token * 1.1)
    assert built_with(generator("cpu", max_num_seqs=2, max_model_len=2048))["kv_cache_memory_bytes"] == int(
        2 * (1024 + 128) * per_token * 1.1
    )
    assert built_with(generator("cpu", kv_cache_gib=0.25))["kv_cache_memory_bytes"] == 2**28


def test_a_config_without_the_attention_shapes_gets_a_kv_cache_of_1_gib(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "eos_token_id": 2}))
    assert built_with(_generator(tmp_path, "cpu"))["kv_cache_memory_bytes"] == 2**30
    # A vision-language model's shapes are its text model's.
    (tmp_path / "config.json").write_text(json.dumps({"text_config": MODEL_CONFIG}))
    assert built_with(_generator(tmp_path, "cpu"))["kv_cache_memory_bytes"] == int(
        512 * (1024 + 128) * 2 * 30 * 3 * 64 * 4 * 1.1
    )


def test_the_engine_process_sees_only_its_ranks_gpu(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    env = engine_env(num_threads=4, device="cuda:3")
    assert env["CUDA_VISIBLE_DEVICES"] == "3"
    # No CPU-engine settings on CUDA: TORCHDYNAMO_DISABLE would turn vLLM's compilation off.
    assert "TORCHDYNAMO_DISABLE" not in env
    # Under an allocation (Slurm, a container) cuda:i is the i-th GPU this process was given.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert engine_env(num_threads=4, device="cuda:1")["CUDA_VISIBLE_DEVICES"] == "5"
    assert visible_device(0, "GPU-aa, GPU-bb") == "GPU-aa"
    with pytest.raises(VLLMEnvironmentError, match="not among the GPUs"):
        visible_device(4)
    # The launcher's rank variables never reach the engine (it would adopt the job's process group).
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("MASTER_ADDR", "10.0.0.1")
    env = engine_env(num_threads=4, device="cpu")
    assert "RANK" not in env and "MASTER_ADDR" not in env
    assert env["TORCHDYNAMO_DISABLE"] == "1"
    assert env["CUDA_VISIBLE_DEVICES"] == "4,5,6,7"  # the CPU engine leaves it as it is


def test_on_cuda_the_engine_runs_in_this_environment_with_llamarl_exec_vllm(monkeypatch, tmp_path):
    monkeypatch.delenv("LLAMARL_VLLM_PYTHON", raising=False)
    monkeypatch.setenv("LLAMARL_CACHE_DIR", str(tmp_path))  # no cached CPU environment either
    monkeypatch.setattr("importlib.util.find_spec", lambda name: object() if name == "vllm" else None)
    assert find_vllm_python(cuda=True) == sys.executable
    monkeypatch.setattr("importlib.util.find_spec", lambda name: None)
    with pytest.raises(VLLMEnvironmentError, match=r"llamarl-exec\[vllm\]"):
        find_vllm_python(cuda=True)
    # An interpreter given explicitly wins on CUDA too.
    assert find_vllm_python(sys.executable, cuda=True) == sys.executable


@pytest.mark.timeout(240)
def test_every_engine_kwarg_is_one_the_real_vllm_takes(generator):
    """vLLM 0.32 (the CPU build here, the same version llamarl-exec[vllm] pins for CUDA) knows every
    keyword the engine passes, on CUDA and on the CPU (a misspelt one would fail only on the GPU)."""
    python = vllm_python_for_tests()
    names = sorted({*built_with(generator("cuda:0")), *built_with(generator("cpu"))})
    script = (
        "import dataclasses, json, sys\n"
        "from vllm.engine.arg_utils import EngineArgs\n"
        "fields = {f.name for f in dataclasses.fields(EngineArgs)}\n"
        "print(json.dumps(sorted(set(json.loads(sys.argv[1])) - fields)))\n"
    )
    result = subprocess.run(
        [python, "-c", script, json.dumps(names)], capture_output=True, text=True, timeout=200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert json.loads(result.stdout.strip().splitlines()[-1]) == []
