"""The vLLM engine's protocol, declared once (`llamarl.exec.generate.vllm.protocol`): which requests the
engine serves, which while a generate runs, one-line refusals of the others; and the engine process's
modules import in the vLLM environment from the import root the client gives it (no workspace torch).
(The engine answering them for real: test_vllm_generator.py.)"""

from __future__ import annotations

import os
import pickle
import subprocess

import pytest

from llamarl.comm import WeightSyncEndpoint
from llamarl.exec.generate.vllm import protocol as p
from llamarl.exec.generate.vllm.env import engine_import_root
from llamarl.exec.testing import vllm_python_for_tests

ONE_OF_EACH = [
    p.Generate(prompts=[[1, 2]], n=2, max_tokens=4, temperature=0.7, stop_token_ids=[2], seed=None),
    p.TurnsAdd(
        turns=[p.Turn(key=3, prompt_ids=[1], max_tokens=4)], temperature=0.0, stop_token_ids=[2], seed=1
    ),
    p.TurnsWait(max_s=0.05),
    p.TurnsAbort(),
    p.Progress(),
    p.Abort(),
    p.Pause(),
    p.Close(),
    p.InitWeightSync(endpoint=WeightSyncEndpoint(host="127.0.0.1", port=1, rank=1, world_size=2)),
    p.ReceiveWeights(timeout_s=30.0),
    p.WeightVersion(),
    p.CloseWeightSync(),
]


def test_every_request_is_declared_once_and_crosses_the_wire_whole():
    assert [type(r) for r in ONE_OF_EACH] == list(p.REQUESTS)
    assert len({r.method for r in p.REQUESTS}) == len(p.REQUESTS)  # one method name each
    for request in ONE_OF_EACH:
        assert pickle.loads(pickle.dumps(request)) == request  # what the socket pair does to it


def test_only_the_nested_requests_are_served_while_a_generate_runs():
    assert set(p.NESTED_METHODS) == {
        "receive_weights",
        "weight_version",
        "progress",
        "abort",
        "pause",
        "close",
    }
    for request in ONE_OF_EACH:
        assert p.refusal(request, generating=False) is None
        why = p.refusal(request, generating=True)
        assert (why is None) == request.nested, request
        if why is not None:
            assert why.startswith(f"{request.method} is not allowed while a generate is in flight")
            assert "\n" not in why


@pytest.mark.parametrize("request_", [("weight_version", {}), "generate", None, p.Request()])
def test_anything_else_is_an_unknown_request_in_one_line(request_):
    for generating in (False, True):
        why = p.refusal(request_, generating=generating)
        assert why is not None and why.startswith("unknown engine request") and "\n" not in why
        assert "receive_weights" in why  # it says what the engine serves


@pytest.mark.vllm
@pytest.mark.timeout(300)
def test_the_engine_modules_import_in_the_vllm_environment_from_the_import_root():
    """What `server.py` imports, in the vLLM environment's interpreter with the engine's PYTHONPATH: the
    protocol and the engine's modules come from this checkout, llamarl.comm too, and nothing else of the
    workspace (llamarl.exec's own __init__ never runs there)."""
    root = engine_import_root()
    code = (
        "import sys, llamarl.comm, llamarl.exec.generate.vllm.engine;"
        "import llamarl.exec.generate.vllm.protocol as p;"
        "print(p.__file__); print('llamarl.exec.config' in sys.modules, 'transformers' in sys.modules)"
    )
    env = {**os.environ, "PYTHONPATH": str(root)}
    done = subprocess.run(
        [vllm_python_for_tests(), "-P", "-c", code], env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, done.stderr[-3000:]
    protocol_file, loaded = done.stdout.split("\n")[:2]
    assert os.path.samefile(protocol_file, p.__file__)
    assert loaded == "False False"
