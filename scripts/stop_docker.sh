#!/usr/bin/env bash
# Stops the Docker engine scripts/start_docker.sh started (the pid it recorded) and what that
# dockerd started below it (its containerd), unless VLLM_LING_KEEP_DOCKER=1. An engine someone
# else started is left alone. The images stay (the container tests' bases are made once per
# machine; README "Two commands" says how to remove them). Exit 0 unless the engine would not stop.
set -uo pipefail
pidfile=${VLLM_LING_DOCKERD_PIDFILE:-/run/vllm-ling-dockerd.pid}
[ -s "$pidfile" ] || exit 0
pid=$(cat "$pidfile")
if [ "${VLLM_LING_KEEP_DOCKER:-0}" = 1 ]; then
  echo "Docker engine kept running (VLLM_LING_KEEP_DOCKER=1; pid $pid; scripts/stop_docker.sh stops it)"
  exit 0
fi
# the pid is still the dockerd we started (not a reused pid)
if ! [ "$(readlink "/proc/$pid/exe" 2>/dev/null)" = "$(command -v dockerd)" ]; then
  rm -f "$pidfile"; exit 0
fi
below=$(ps -o pid= --ppid "$pid" 2>/dev/null | tr -d ' ')
# running: present and not a zombie (an exited process nobody has reaped yet is gone for us)
running() { [ -r "/proc/$1/stat" ] && [ "$(sed 's/.*) //' "/proc/$1/stat" | cut -d' ' -f1)" != Z ]; }
kill -TERM "$pid"
for _ in $(seq 60); do
  left=
  for p in $pid $below; do running "$p" && left="$left $p"; done
  if [ -z "$left" ]; then
    rm -f "$pidfile"
    echo "stopped the Docker engine the tests started (dockerd pid $pid)"
    exit 0
  fi
  sleep 0.5
done
for p in $left; do kill -KILL "$p" 2>/dev/null; done
rm -f "$pidfile"
echo "the Docker engine (dockerd pid $pid) did not stop within 30 s: killed$left" >&2
exit 1
