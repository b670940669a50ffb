#!/usr/bin/env bash
# The project's test command (README, `make test`, .ci/run): the whole suite on the CPU,
# real vLLM servers included; GPU tests skip themselves without CUDA.
# A test run leaves the checkout as it found it: the verified-pairs record (verified.csv, tracked)
# gets its row only when asked (VLLM_LING_RECORD_VERIFIED=1, the whole suite), and whatever else
# the run changed in the checkout is named at the end (a failure under CI).
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
checkout_state() { git status --porcelain --untracked-files=all 2>/dev/null; }
before=$(checkout_state)
log=$(mktemp)
.venv/bin/python -m pytest -ra --durations=25 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# pytest's own summary line, for the whole suite only
summary=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
rm -f "$log"
changed=$(diff <(echo "$before") <(checkout_state) | sed -n 's/^> //p')
if [ -n "$changed" ]; then
  echo "the test run changed the checkout (tests must write under their tmp_path):" >&2
  echo "$changed" >&2
  [ -n "${CI:-}" ] && [ $rc -eq 0 ] && rc=1
fi
if [ "${VLLM_LING_RECORD_VERIFIED:-0}" = 1 ]; then
  if [ $# -eq 0 ] && [ -n "$summary" ]; then
    .venv/bin/python scripts/record_verified.py --suite cpu --result "$summary" || true
  else
    echo "VLLM_LING_RECORD_VERIFIED=1: nothing recorded (only the whole suite's summary is)" >&2
  fi
fi
# pytest exits 5 when nothing was collected: that is a failure for this project.
[ $rc -eq 5 ] && echo "no tests were collected" >&2 && exit 1
exit $rc
