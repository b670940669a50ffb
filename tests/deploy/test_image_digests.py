"""Every third-party image the Dockerfile and the compose file start from is pinned by digest
(`name:tag@sha256:<64 hex>`, the tag kept for readers); images built from this repository
are exempt (the chart pins its own with image.digest, tests/deploy/test_helm_chart.py)."""

from __future__ import annotations

import re

import yaml

from ._tools import DOCKER_DIR

PINNED = re.compile(r"^[a-z0-9./_-]+:[\w.-]+@sha256:[0-9a-f]{64}$")
DEFAULT = re.compile(r"^\$\{\w+:-(.+)\}$")
# Images whose digest could not be looked up where they were written (no registry access):
# still pinned by tag only, since a made-up digest would break every build; docker/Dockerfile
# says how to pin them. This list may only shrink (issue 15 stays open until it is empty).
NOT_YET_PINNED = {"vllm/vllm-openai:v0.32.0-cu130", "vllm/vllm-openai-cpu:v0.32.0"}


def default_of(value: str) -> str:
    """`${VAR:-default}` -> default (what runs when the caller sets nothing)."""
    match = DEFAULT.match(value.strip())
    return match.group(1) if match else value.strip()


def dockerfile_images() -> list[str]:
    text = (DOCKER_DIR / "Dockerfile").read_text()
    args = dict(re.findall(r"^ARG (\w+)=(\S+)", text, re.M))
    images = []
    for ref in re.findall(r"^FROM (\S+)", text, re.M):
        arg = re.fullmatch(r"\$\{(\w+)\}", ref)
        images.append(args[arg.group(1)] if arg else ref)
    return images


def compose_images() -> list[str]:
    compose = yaml.safe_load((DOCKER_DIR / "compose.yaml").read_text())
    services = compose["services"].values()
    # Built from this repository (a service with `build:` names it; others reuse it).
    built_here = {default_of(svc["image"]) for svc in services if svc.get("build")}
    images = []
    for svc in services:
        build = svc.get("build")
        if build:  # its base is a build argument
            images += [default_of(v) for k, v in (build.get("args") or {}).items() if k.endswith("IMAGE")]
        elif default_of(svc["image"]) not in built_here:
            images.append(default_of(svc["image"]))
    return images


def check(images: list[str]) -> list[str]:
    problems = []
    for image in images:
        if image in NOT_YET_PINNED:
            continue
        if not PINNED.match(image):
            problems.append(f"{image}: not pinned by digest (name:tag@sha256:<64 hex>)")
        elif image.endswith("@sha256:" + "0" * 64):
            problems.append(f"{image}: a made-up digest (all zeros)")
    return problems


def test_every_base_image_is_pinned_by_digest():
    images = dockerfile_images() + compose_images()
    assert len(images) >= 5  # vLLM GPU + CPU bases, nginx, prometheus, grafana
    assert check(images) == []


def test_the_check_catches_tags_and_new_placeholders():
    assert check(["nginx:1.27-alpine"]) == ["nginx:1.27-alpine: not pinned by digest (name:tag@sha256:<64 hex>)"]
    assert check(["nginx@sha256:" + "a" * 64])  # a digest without its tag hides what it is
    assert check(["nginx:1.27@sha256:" + "0" * 64])
    assert check(["vllm/vllm-openai:v0.33.0"])  # only the listed tags may wait for their digest
    assert check(["prom/prometheus:v3.5.0@sha256:" + "a" * 63])
