#!/usr/bin/env bash
# Shared by start-head.sh and start-worker.sh: reads spark.env and builds the docker run
# arguments both nodes need (host networking, RDMA devices, NCCL/Gloo/vLLM interface env).
set -euo pipefail
here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
env_file="${VLLM_LING_SPARK_ENV:-$here/spark.env}"
[[ -f "$env_file" ]] || { echo "missing $env_file: copy spark.env.example and edit it" >&2; exit 2; }
# shellcheck source=/dev/null
source "$env_file"
for v in VLLM_LING_IFACE VLLM_LING_HEAD_IP VLLM_LING_WORKER_IP VLLM_LING_IMAGE VLLM_LING_MODELS_DIR VLLM_LING_MODEL_NAME VLLM_LING_HUMMING_DIR; do
  [[ -n "${!v:-}" ]] || { echo "$env_file: $v is empty" >&2; exit 2; }
done
[[ -d "$VLLM_LING_MODELS_DIR/$VLLM_LING_MODEL_NAME" ]] || { echo "no checkpoint at $VLLM_LING_MODELS_DIR/$VLLM_LING_MODEL_NAME on $(hostname)" >&2; exit 2; }
ip -br addr show "$VLLM_LING_IFACE" >/dev/null 2>&1 || { echo "interface $VLLM_LING_IFACE not found on $(hostname)" >&2; exit 2; }
mkdir -p "$VLLM_LING_HUMMING_DIR"

# node_args HOST_IP: docker run arguments common to head and worker.
node_args() {
  local host_ip="$1"
  local args=(
    --rm --gpus all --network host --ipc host --shm-size 16g
    --ulimit memlock=-1 --ulimit stack=67108864
    -v "$VLLM_LING_MODELS_DIR:/models:ro"
    -v "$VLLM_LING_HUMMING_DIR:/cache/humming"
    -e "VLLM_HOST_IP=$host_ip"
    -e "NCCL_SOCKET_IFNAME=$VLLM_LING_IFACE"
    -e "GLOO_SOCKET_IFNAME=$VLLM_LING_IFACE"
    -e "UCX_NET_DEVICES=$VLLM_LING_IFACE"
    -e "TP_SOCKET_IFNAME=$VLLM_LING_IFACE"
    -e "NCCL_IB_DISABLE=0"
    -e "VLLM_LING_MODEL=/models/$VLLM_LING_MODEL_NAME"
  )
  if [[ -n "${VLLM_LING_IB_HCA:-}" ]]; then args+=(-e "NCCL_IB_HCA=$VLLM_LING_IB_HCA"); fi
  # RDMA: the verbs devices, and IPC_LOCK so NCCL can pin memory for the NIC.
  if [[ -d /dev/infiniband ]]; then args+=(--device /dev/infiniband --cap-add IPC_LOCK); fi
  printf '%s\n' "${args[@]}"
}
