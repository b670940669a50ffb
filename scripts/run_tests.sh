#!/usr/bin/env bash
# The project's test command (README, `make test`, .ci/run): the whole suite on the CPU,
# real vLLM servers included; GPU tests skip themselves without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
log=$(mktemp)
.venv/bin/python -m pytest -ra --durations=25 "$@" 2>&1 | tee "$log"
rc=${PIPESTATUS[0]}
# the verified-pairs record (verified.csv): pytest's own summary line, for the whole suite only
summary=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$log" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
if [ $# -eq 0 ] && [ -n "$summary" ]; then
  .venv/bin/python scripts/record_verified.py --suite cpu --result "$summary" || true
fi
rm -f "$log"
# pytest exits 5 when nothing was collected: that is a failure for this project.
[ $rc -eq 5 ] && echo "no tests were collected" >&2 && exit 1
exit $rc
