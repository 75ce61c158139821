#!/usr/bin/env bash
# llamarl on one GPU in a few minutes: FSDP2 step (NCCL vs gloo), weight sync trainer -> HF generator,
# DCP round trip, the app in async and stream; prints one table (tools/gpu_check.py says what each is).
#
# Runs with the system python3 (torch with CUDA) and this checkout on PYTHONPATH: no virtual environment,
# no network. Packages the machine lacks come from wheels carried in .whl/ and are unpacked into a
# temporary folder (pip --no-index --target, nothing system-wide). Fetch those wheels once, on a machine
# with network, into the checkout (they are not committed; .git/info/exclude the folder):
#     tools/gpu_check.sh --fetch-wheels
# Then on the GPU machine:
#     tools/gpu_check.sh              # or --cpu for a dry run on a machine without a GPU
#
# Environment: PYTHON (default python3), GPU_CHECK_TIMEOUT_S (default 470: the whole run is stopped then).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
PYTHON="${PYTHON:-python3}"
WHEELS="$ROOT/.whl"
# What the image with torch may lack (versions as the workspace locks them), all for CPython 3.12.
NEEDED=(pydantic==2.14.4 pydantic-core==2.50.5 pydantic-settings==2.16.3 annotated-types==0.8.0
        typing-inspection==0.4.5 python-dotenv==1.2.4 tomli-w==1.2.0)

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    mkdir -p "$WHEELS"
    "$PYTHON" -m pip download --no-deps --only-binary=:all: --python-version "${WHEEL_PYTHON_VERSION:-3.12}" \
        --implementation cp \
        --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
        -d "$WHEELS" "${NEEDED[@]}"
    exit 0
fi

export PYTHONPATH="$ROOT/packages/llamarl-comm/src:$ROOT/packages/llamarl-algo/src:$ROOT/packages/llamarl-exec/src:$ROOT/packages/llamarl-control/src${PYTHONPATH:+:$PYTHONPATH}"
if ! "$PYTHON" -c "import pydantic, pydantic_settings, tomli_w" 2>/dev/null; then
    if ! compgen -G "$WHEELS/*.whl" >/dev/null; then
        echo "gpu_check: $PYTHON lacks pydantic, pydantic-settings or tomli-w, and $WHEELS holds no wheels:" \
             "run tools/gpu_check.sh --fetch-wheels where there is network" >&2
        exit 2
    fi
    SITE="$(mktemp -d)/site"
    "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$SITE" "$WHEELS"/*.whl
    export PYTHONPATH="$SITE:$PYTHONPATH"
fi
export PYTHONUNBUFFERED=1
exec timeout "${GPU_CHECK_TIMEOUT_S:-470}" "$PYTHON" "$ROOT/tools/gpu_check.py" "$@"
