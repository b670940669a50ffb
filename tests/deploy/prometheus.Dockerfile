# Prometheus from Debian's package, standing in for prom/prometheus (which cannot be pulled
# where the tests run) in the compose test; scripts/docker_bases.sh builds it on the locally
# bootstrapped Debian base. compose.yaml passes the flags; the entrypoint is the binary.
ARG BASE_IMAGE=local/debian:bookworm
FROM ${BASE_IMAGE}
# hadolint ignore=DL3008
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends prometheus wget \
 && rm -rf /var/lib/apt/lists/* \
 && mkdir -p /prometheus && chown prometheus:prometheus /prometheus
# hadolint ignore=DL3066
USER prometheus
ENTRYPOINT ["/usr/bin/prometheus"]
