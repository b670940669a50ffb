#!/usr/bin/env bash
# Run on the second Spark first: a Ray worker that joins the head over the ConnectX-7 link.
set -euo pipefail
source "$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)/common.sh"
mapfile -t args < <(node_args "$VLLM_LING_WORKER_IP")
exec docker run "${args[@]}" --name vllm-ling-worker --entrypoint vllm-ling-ray \
  "$VLLM_LING_IMAGE" worker --head "$VLLM_LING_HEAD_IP:6379"
