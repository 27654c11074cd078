#!/usr/bin/env bash
# Set up .venv for kvfuzz on a CPU-only machine: CPU torch, vLLM 0.33.0 with
# only the dependencies its KV-cache and config modules import, kvfuzz itself
# (editable) and the test tools. Idempotent: reruns only when a requirements
# file or pyproject.toml changed.
#
# Environment:
#   KVFUZZ_VENV    virtual environment folder (default: .venv)
#   KVFUZZ_PYTHON  interpreter used to create it (default: python3)
#   KVFUZZ_TORCH   torch requirement (default: torch==2.13.0, the CPU build
#                  in this machine's wheel store; elsewhere add
#                  PIP_EXTRA_INDEX_URL for a CPU wheel index)
#
# On a machine that already has vLLM (a GPU box), skip this script and run
# `pip install -e .` in that environment instead.
set -euo pipefail
cd "$(dirname "$0")/.."

venv=${KVFUZZ_VENV:-.venv}
python=${KVFUZZ_PYTHON:-python3}
torch_req=${KVFUZZ_TORCH:-torch==2.13.0}
stamp="$venv/.kvfuzz-bootstrap"
want=$(cat pyproject.toml requirements/* | sha256sum | cut -d' ' -f1)

if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ]; then
    exit 0
fi

echo "kvfuzz: setting up $venv (CPU torch, vLLM 0.33.0 without CUDA dependencies;" \
     "about 4 minutes the first time, one line per step)" >&2
# One line per step on stderr, so a first set-up never sits silent for minutes.
step() { echo "kvfuzz: [$1/8] $2" >&2; }
if [ -x "$venv/bin/python" ]; then
    step 1 "virtual environment $venv: already there"
else
    step 1 "creating the virtual environment $venv ($python -m venv)"
    "$python" -m venv "$venv"
fi
log="$venv/bootstrap.log"
: > "$log"
echo "kvfuzz: pip's output goes to $log; its 'vllm 0.33.0 requires ..., which is" \
     "not installed' lines are expected (vLLM is installed with --no-deps)" >&2
pip=("$venv/bin/python" -m pip --disable-pip-version-check -q)
run_pip() {
    if ! "${pip[@]}" "$@" >> "$log" 2>&1; then
        tail -n 40 "$log" >&2
        echo "kvfuzz: pip install $* failed; full output in $log" >&2
        exit 1
    fi
}
step 2 "upgrading pip"
run_pip install --upgrade pip
step 3 "CPU torch ($torch_req; the longest step)"
run_pip install "$torch_req"
step 4 "vLLM without its dependencies (requirements/vllm-nodeps.txt)"
run_pip install --no-deps -r requirements/vllm-nodeps.txt
step 5 "the light packages vLLM's KV-cache and config modules import (requirements/vllm-cpu.txt)"
run_pip install -r requirements/vllm-cpu.txt -c requirements/vllm-cpu.lock
step 6 "the test tools (requirements/test.txt)"
run_pip install -r requirements/test.txt
step 7 "kvfuzz itself (editable)"
run_pip install --no-deps -e .
step 8 "checking that vLLM's KV cache modules import"
"$venv/bin/python" -c "import vllm.v1.core.kv_cache_manager, vllm.config" 2>/dev/null \
    || { echo "kvfuzz: vLLM's KV cache modules do not import in $venv" >&2; exit 1; }
echo "$want" > "$stamp"
echo "kvfuzz: $venv is ready" >&2
