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
start=$SECONDS
# The whole suite (no test paths given) runs the Docker engine's and the container image's tests, then the
# speculative end-to-end module (SIDE, in that order, as alone) in a pytest process of their own beside the rest:
# the Docker tests wait on the engine's builds and containers most of their 4 minutes, while the rest is mostly
# one core importing vLLM (CI has 2; on a 2-core EPYC 1038 s in one process, 823 s with the Docker tests beside,
# 715 s with the speculative servers' 3.5 minutes moved beside them too, then the main process 726 s beside 427 s,
# so the container entrypoint's server tests, 80 s, went beside as well; main 759 s beside 543 s on 2026-12-07, so
# the engine-death-under-load server test, 55 s, too). VLLM_LING_TESTS_SIDE=0: one process.
SIDE=(tests/deploy/test_docker_engine.py tests/deploy/test_docker_image.py tests/runtime/test_speculative_e2e.py
      tests/deploy/test_entrypoint_server.py tests/deploy/test_serve_lifecycle.py)
whole=1
for arg in "$@"; do [ -e "${arg%%::*}" ] && whole=0; done
side_rc=0 side_log=""
if [ "$whole" = 1 ] && [ "${VLLM_LING_TESTS_SIDE:-1}" != 0 ]; then
  side_log=$(mktemp)
  .venv/bin/python -m pytest -ra "$@" "${SIDE[@]}" > "$side_log" 2>&1 &
  side_pid=$!
  .venv/bin/python -m pytest -ra --durations=25 "$@" "${SIDE[@]/#/--ignore=}" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
  wait "$side_pid"; side_rc=$?
  echo "==== ${SIDE[*]}, run beside the rest:"
  cat "$side_log"
else
  .venv/bin/python -m pytest -ra --durations=25 "$@" 2>&1 | tee "$log"
  rc=${PIPESTATUS[0]}
fi
# pytest's own summary line, for the whole suite only (with a side process: both summed, the wall time)
summary_of() { grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$1" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//'; }
summary=$(summary_of "$log")
if [ -n "$side_log" ]; then
  summary=$(python3 - "$summary" "$(summary_of "$side_log")" "$((SECONDS - start))" <<'PY'
import re, sys
counts = {}
for line in sys.argv[1:3]:
    for n, what in re.findall(r"(\d+) (passed|failed|errors?|skipped|warnings?|deselected|xfailed|xpassed)", line):
        what = {"error": "errors", "warning": "warnings"}.get(what, what)
        counts[what] = counts.get(what, 0) + int(n)
order = ["failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings", "errors"]
wall = int(sys.argv[3])
print(", ".join(f"{counts[k]} {k}" for k in order if k in counts)
      + f" in {wall}s ({wall // 60}:{wall % 60:02d}, two processes)" if sys.argv[1] and sys.argv[2] else "")
PY
)
  rm -f "$side_log"
  [ $rc -eq 0 ] && [ $side_rc -ne 0 ] && rc=$side_rc
fi
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
