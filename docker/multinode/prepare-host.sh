#!/usr/bin/env bash
# Run with sudo on EACH Spark before starting the containers (and again before a restart):
# frees the unified memory that the page cache and a desktop session hold, so vLLM's
# --gpu-memory-utilization fraction is really available.
set -euo pipefail
[[ $EUID -eq 0 ]] || { echo "run with sudo" >&2; exit 2; }
iface="${1:-enp1s0f1np1}"
# Page cache from reading ~70 GB of weights counts against the same 128 GB the GPU uses.
sync && echo 3 > /proc/sys/vm/drop_caches
# Keep the kernel from swapping the model's pages out under pressure.
sysctl -q vm.swappiness=1
# Jumbo frames on the direct link (both ends must match).
ip link set dev "$iface" mtu 9000 || echo "could not set MTU 9000 on $iface" >&2
free -g
echo "Tip: a graphical session holds GPU memory; 'systemctl isolate multi-user.target' frees it."
