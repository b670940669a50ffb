#!/usr/bin/env bash
# Makes a Docker engine answer for the container tests (tests/deploy/test_docker_image.py):
# starts dockerd (installed by scripts/install_test_tools.sh) when nothing answers, and waits.
# Idempotent: with an engine already running it only checks. Exit 0: `docker info` answers;
# exit 1: no engine, with the reason as the last line. When it started dockerd itself it says so
# on stdout ("started dockerd (pid N)") and records the pid, so scripts/stop_docker.sh stops that
# engine (and only that one) afterwards.
set -uo pipefail
log=${VLLM_LING_DOCKERD_LOG:-/var/log/vllm-ling-dockerd.log}
pidfile=${VLLM_LING_DOCKERD_PIDFILE:-/run/vllm-ling-dockerd.pid}
if docker info >/dev/null 2>&1; then exit 0; fi
if ! command -v dockerd >/dev/null 2>&1; then
  echo "dockerd is not installed (apt-get install docker.io; scripts/install_test_tools.sh does it as root)" >&2
  exit 1
fi
if [ "$(id -u)" != 0 ]; then
  echo "no Docker engine answers and only root can start dockerd here" >&2; exit 1
fi
started=
if ! [ -s /var/run/docker.pid ] || ! kill -0 "$(cat /var/run/docker.pid)" 2>/dev/null; then
  # No systemd on these machines: dockerd runs detached, with cgroupfs (nothing to delegate to).
  nohup dockerd --exec-opt native.cgroupdriver=cgroupfs >>"$log" 2>&1 &
  started=$!
  echo "$started" >"$pidfile"
fi
for _ in $(seq 60); do
  if docker info >/dev/null 2>&1; then
    [ -n "$started" ] && echo "started dockerd (pid $started); scripts/stop_docker.sh stops it"
    exit 0
  fi
  sleep 1
done
tail -n 5 "$log" >&2
echo "dockerd did not answer within 60 s (log: $log)" >&2
exit 1
