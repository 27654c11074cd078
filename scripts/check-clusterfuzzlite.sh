#!/usr/bin/env bash
# Check the ClusterFuzzLite / OSS-Fuzz layout without Docker: run
# .clusterfuzzlite/build.sh against a scratch OUT folder (with a stand-in for
# the builder's compile_python_fuzzer that writes a launcher instead of a
# PyInstaller bundle), then run every fuzzer on its seed corpus as the
# runner would. Uses .venv (make test / scripts/bootstrap.sh sets it up).
#
# Usage: scripts/check-clusterfuzzlite.sh [OUT] ; KVFUZZ_FUZZ_SECONDS (default 30)
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$PWD
out=$(realpath -m "${1:-$(mktemp -d)}")
seconds=${KVFUZZ_FUZZ_SECONDS:-30}
mkdir -p "$out"
src=$(mktemp -d)
ln -s "$repo" "$src/kvfuzz"
export SRC=$src OUT=$out KVFUZZ_SKIP_INSTALL=1 KVFUZZ_PYTHON_BIN=$repo/.venv/bin/python
export PATH="$repo/.venv/bin:$PATH"

compile_python_fuzzer() {
    local fuzzer=$1 name
    name=$(basename "$fuzzer" .py)
    printf '#!/usr/bin/env bash\ncd %q && exec %q %q "$@"\n' \
        "$SRC/kvfuzz" "$KVFUZZ_PYTHON_BIN" "$fuzzer" > "$OUT/$name"
    chmod +x "$OUT/$name"
}
export -f compile_python_fuzzer

bash .clusterfuzzlite/build.sh
for fuzzer in "$OUT"/*_fuzzer; do
    name=$(basename "$fuzzer")
    corpus=$(mktemp -d)
    "$KVFUZZ_PYTHON_BIN" -c "import sys, zipfile; zipfile.ZipFile(sys.argv[1]).extractall(sys.argv[2])" \
        "$OUT/${name}_seed_corpus.zip" "$corpus"
    set +e
    "$fuzzer" "$corpus" -max_total_time="$seconds" -artifact_prefix="$OUT/$name-" \
        > "$OUT/$name.log" 2>&1
    status=$?
    set -e
    crash=$(ls "$OUT/$name-"crash-* 2>/dev/null | head -n 1 || true)
    runs=$(grep -o 'Done [0-9]* runs' "$OUT/$name.log" | tail -n 1 || true)
    if [ -n "$crash" ]; then
        echo "$name: finding saved to $crash (exit $status)"
    elif [ "$status" -eq 0 ]; then
        echo "$name: clean, ${runs:-no summary} in ${seconds} s"
    else
        echo "$name: failed to run (exit $status), see $OUT/$name.log"
        exit 1
    fi
done
