#!/usr/bin/env bash
# kvfuzz in any CI system: replay the corpus, then run a bounded campaign.
#
# Leaves everything under $KVFUZZ_CI_OUT (default kvfuzz-ci-out/):
#   replay-junit.xml, replay.sarif, replay.json   the corpus replay
#   campaign/   findings/, report.md, summary.json, junit.xml, kvfuzz.sarif,
#               hypothesis-db/ (keep it between runs to replay old failures)
#
# Environment:
#   KVFUZZ_CI_OUT        output folder (default: kvfuzz-ci-out)
#   KVFUZZ_CI_SECONDS    campaign wall time in seconds (default: 300)
#   KVFUZZ_CI_JOBS       campaign worker processes (default: 2)
#   KVFUZZ_CI_SEED       campaign seed (default: the run number, else 0)
#   KVFUZZ_CI_VARIANTS   campaign variants (default: unfixed,fixed)
#   KVFUZZ_CI_REPLAY_VARIANTS
#                        corpus replay variants (default: candidate, the
#                        variant the corpus replays clean on; each file's
#                        expect block is checked for the replayed variants)
#
# Exit status: 3 if kvfuzz itself failed in either step (or the set-up
# failed), 2 for bad input or usage, 1 if the corpus replay fails (the
# variants under test regressed); a campaign's new findings are reported,
# not fatal, unless KVFUZZ_CI_STRICT=1.
set -uo pipefail
cd "$(dirname "$0")/.."

out=${KVFUZZ_CI_OUT:-kvfuzz-ci-out}
seconds=${KVFUZZ_CI_SECONDS:-300}
jobs=${KVFUZZ_CI_JOBS:-2}
seed=${KVFUZZ_CI_SEED:-${GITHUB_RUN_NUMBER:-0}}
variants=${KVFUZZ_CI_VARIANTS:-unfixed,fixed}
annotations=()
[ -n "${GITHUB_ACTIONS:-}" ] && annotations=(--github-annotations)

scripts/bootstrap.sh || exit 3
kvfuzz=.venv/bin/kvfuzz
mkdir -p "$out"

# 1. The corpus must replay clean on the fixed variant (seeds, handed cases,
#    regressions all record their expectations for both variants).
"$kvfuzz" replay corpora --variants "${KVFUZZ_CI_REPLAY_VARIANTS:-candidate}" \
    --report "$out/replay.json" \
    --junit-xml "$out/replay-junit.xml" --sarif "$out/replay.sarif" "${annotations[@]}" \
    > "$out/replay.txt"
replay=$?
tail -n 2 "$out/replay.txt"

# 2. A bounded campaign; its example database makes the next run replay old failures.
"$kvfuzz" fuzz --variants "$variants" --seed "$seed" --seconds "$seconds" --jobs "$jobs" \
    --out "$out/campaign" --quiet --junit-xml "$out/campaign/junit.xml" \
    --sarif "$out/campaign/kvfuzz.sarif"
campaign=$?

echo "kvfuzz CI: replay exit $replay, campaign exit $campaign; outputs in $out/"
for code in 3 2; do  # kvfuzz's own failure first, then bad input or usage
    if [ "$replay" -eq "$code" ] || [ "$campaign" -eq "$code" ]; then exit "$code"; fi
done
if [ "$replay" -gt 3 ] || [ "$campaign" -gt 3 ]; then exit 3; fi  # killed or interrupted
if [ "$replay" -ne 0 ]; then exit 1; fi
if [ "${KVFUZZ_CI_STRICT:-0}" = "1" ] && [ "$campaign" -ne 0 ]; then exit 1; fi
exit 0
