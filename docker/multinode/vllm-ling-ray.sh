#!/usr/bin/env bash
# vllm-ling-ray: start one node of a Ray cluster for multi-node vLLM serving.
#
#   vllm-ling-ray head   --nodes N [--port 6379] [--wait 900] [--workers ADDR,...] [-- vllm-ling serve args...]
#       starts the Ray head, waits until N nodes (this one included) have joined (after
#       --wait seconds: exit 2 naming the --workers addresses that never joined), then runs
#       `vllm-ling serve ... --distributed-executor-backend ray` and watches the nodes: a node
#       lost while serving stops the server and exits 1 naming the node
#       (python3 -m vllm_ling.launcher.ray_cluster does both).
#   vllm-ling-ray worker --head HOST[:PORT]
#       joins the head and blocks (the container lives as long as the Ray node).
#
# Used by docker/multinode/start-*.sh (two DGX Sparks) and by the Helm chart's
# LeaderWorkerSet. Environment it honours:
#   VLLM_HOST_IP            this node's address on the fast link (Ray, vLLM and NCCL bind it)
#   VLLM_LING_IFACE         when VLLM_HOST_IP is unset: take the IPv4 address of this interface
#   VLLM_LING_RAY_NUM_GPUS  GPUs this node offers Ray (default: all visible, via nvidia-smi)
#   RAY_memory_monitor_refresh_ms
#                           defaults to 0 (monitor off): on unified memory (DGX Spark) the
#                           model's GPU memory counts as host memory, and Ray's OOM monitor
#                           would kill the workers that hold the weights.
#   RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S
#                           defaults to 0 (no drain): on SIGTERM Ray would first ask the head to
#                           drain this node for up to 30 s, which quiesces Ray Serve proxies (a vLLM
#                           cluster has none) and, with the head stopping too, only waits for it.
set -euo pipefail

die() { echo "vllm-ling-ray: error: $*" >&2; exit 2; }

export RAY_memory_monitor_refresh_ms="${RAY_memory_monitor_refresh_ms:-0}"
export RAY_USAGE_STATS_ENABLED="${RAY_USAGE_STATS_ENABLED:-0}"
export RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="${RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S:-0}"

role="${1:-}"; shift || true
nodes=""; port=6379; wait_s=900; head=""; workers=""
while [[ $# -gt 0 ]]; do
  case "$1" in
    --nodes) nodes="$2"; shift 2 ;;
    --nodes=*) nodes="${1#*=}"; shift ;;
    --port) port="$2"; shift 2 ;;
    --port=*) port="${1#*=}"; shift ;;
    --wait) wait_s="$2"; shift 2 ;;
    --wait=*) wait_s="${1#*=}"; shift ;;
    --workers) workers="$2"; shift 2 ;;
    --workers=*) workers="${1#*=}"; shift ;;
    --head) head="$2"; shift 2 ;;
    --head=*) head="${1#*=}"; shift ;;
    --) shift; break ;;
    *) die "unknown option $1 (see the header of $0)" ;;
  esac
done

[[ "$role" == head || "$role" == worker ]] \
  || die "usage: vllm-ling-ray head --nodes N [-- serve args] | vllm-ling-ray worker --head HOST[:PORT]"

num_gpus="${VLLM_LING_RAY_NUM_GPUS:-}"
if [[ -z "$num_gpus" ]]; then
  num_gpus="$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)"
fi
[[ "$num_gpus" =~ ^[0-9]+$ && "$num_gpus" -ge 1 ]] || die "no GPU visible to this node (set VLLM_LING_RAY_NUM_GPUS)"

if [[ -z "${VLLM_HOST_IP:-}" && -n "${VLLM_LING_IFACE:-}" ]]; then
  # SIOCGIFADDR through Python: the image has no iproute2.
  VLLM_HOST_IP="$(python3 -c 'import fcntl, socket, struct, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
print(socket.inet_ntoa(fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", sys.argv[1][:15].encode()))[20:24]))' "$VLLM_LING_IFACE")" \
    || die "interface $VLLM_LING_IFACE has no IPv4 address"
  export VLLM_HOST_IP
fi

ip_args=()
if [[ -n "${VLLM_HOST_IP:-}" ]]; then ip_args=(--node-ip-address="$VLLM_HOST_IP"); fi

case "$role" in
  head)
    [[ "$nodes" =~ ^[0-9]+$ && "$nodes" -ge 2 ]] || die "head needs --nodes N with N >= 2"
    ray start --head --port="$port" "${ip_args[@]}" --num-gpus="$num_gpus" \
      --include-dashboard=false --disable-usage-stats
    # The waiter and the server's watcher are Ray drivers of this cluster.
    export RAY_ADDRESS="${VLLM_HOST_IP:-127.0.0.1}:${port}"
    python3 -m vllm_ling.launcher.ray_cluster wait --nodes "$nodes" --timeout "$wait_s" --workers "$workers" \
      || exit 2
    exec python3 -m vllm_ling.launcher.ray_cluster serve -- \
      vllm-ling serve "$@" --distributed-executor-backend ray
    ;;
  worker)
    [[ -n "$head" ]] || die "worker needs --head HOST[:PORT]"
    [[ "$head" == *:* ]] || head="${head}:${port}"
    exec ray start --address="$head" "${ip_args[@]}" --num-gpus="$num_gpus" --block
    ;;
esac
