#!/usr/bin/env bash
# Run on the first Spark after start-worker.sh: Ray head, waits for the worker, then serves
# Ling-3.0-flash with tensor parallel 2 across both Sparks on port 8000.
# Extra arguments go to `vllm-ling serve` (for example --max-model-len 65536).
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"
mapfile -t args < <(node_args "$VLLM_LING_HEAD_IP")
if [[ -n "${VLLM_LING_API_KEY_FILE:-}" ]]; then
  [[ -r "$VLLM_LING_API_KEY_FILE" ]] || { echo "cannot read $VLLM_LING_API_KEY_FILE" >&2; exit 2; }
  args+=(-v "$VLLM_LING_API_KEY_FILE:/run/secrets/vllm-ling-api-key:ro"
         -e "VLLM_LING_API_KEY_FILE=/run/secrets/vllm-ling-api-key")
fi
# Without a key file vllm-ling serve refuses to serve the network unless this says so.
if [[ -n "${VLLM_LING_ALLOW_NO_API_KEY:-}" ]]; then
  args+=(-e "VLLM_LING_ALLOW_NO_API_KEY=$VLLM_LING_ALLOW_NO_API_KEY")
fi
exec docker run "${args[@]}" --name vllm-ling-head --entrypoint vllm-ling-ray \
  "$VLLM_LING_IMAGE" head --nodes 2 --workers "$VLLM_LING_WORKER_IP" -- --tensor-parallel-size 2 "$@"
