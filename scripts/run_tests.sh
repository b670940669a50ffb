#!/usr/bin/env bash
# The project's test command (README, `make test`, .ci/run): the whole suite on the CPU,
# real vLLM servers included; GPU tests skip themselves without CUDA.
set -uo pipefail
cd "$(dirname "$0")/.."
export VLLM_CPU_KVCACHE_SPACE=${VLLM_CPU_KVCACHE_SPACE:-1}
.venv/bin/python -m pytest -ra --durations=25 "$@"
rc=$?
# pytest exits 5 when nothing was collected: that is a failure for this project.
[ $rc -eq 5 ] && echo "no tests were collected" >&2 && exit 1
exit $rc
