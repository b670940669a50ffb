"""docker/Dockerfile: hadolint (required in CI) and the properties the image must have."""

from __future__ import annotations

import fnmatch
import json
import re

import pytest

from vllm_ling import versions

from ._tools import DOCKER_DIR, REPO, find_tool, run

DOCKERFILE = DOCKER_DIR / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with line continuations joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    result = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            result.append((word.upper(), rest.strip()))
    return result


def test_hadolint_passes():
    hadolint = find_tool("hadolint")
    result = run([hadolint, "--no-color", str(DOCKERFILE)])
    assert result.returncode == 0, result.stdout + result.stderr


def test_hadolint_really_lints():
    """A Dockerfile with known violations must fail: the check above cannot pass vacuously."""
    hadolint = find_tool("hadolint")
    result = run([hadolint, "--no-color", "-"],
                 input="FROM ubuntu:latest\nRUN apt-get install curl\nUSER root\n")
    assert result.returncode != 0
    assert "DL3007" in result.stdout  # latest tag


def test_base_image_and_versions_match_versions_py():
    args = dict(a.split("=", 1) for i, a in instructions() if i == "ARG" and "=" in a)
    assert args["VLLM_IMAGE"].startswith(f"vllm/vllm-openai:v{versions.TESTED_VLLM_VERSION}")
    assert args["TESTED_VLLM_VERSION"] == versions.TESTED_VLLM_VERSION
    assert args["TESTED_HUMMING_VERSION"] == versions.TESTED_HUMMING_VERSION
    assert args["TESTED_RAY_VERSION"] == versions.TESTED_RAY_VERSION


def test_ray_extra_pins_the_tested_ray():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["ray"] == [f"ray=={versions.TESTED_RAY_VERSION}"]
    assert "vllm-ling[ray]" in extras["test"]  # the two-node tests need it


def test_runtime_contract():
    ins = instructions()
    values = {}
    for word, rest in ins:
        values.setdefault(word, []).append(rest)
    # Non-root, numeric (Kubernetes runAsNonRoot can check it).
    user = values["USER"][-1]
    assert re.fullmatch(r"\$\{VLLM_LING_UID\}:\$\{VLLM_LING_UID\}|\d+(:\d+)?", user), user
    uid = dict(a.split("=", 1) for a in values["ARG"] if "=" in a)["VLLM_LING_UID"]
    assert int(uid) > 0
    assert json.loads(values["VOLUME"][-1]) == ["/models", "/cache/huggingface", "/cache/humming"]
    assert values["EXPOSE"] == ["8000"]
    healthcheck = values["HEALTHCHECK"][-1]
    assert "/health" in healthcheck and "--start-period=" in healthcheck
    assert json.loads(values["ENTRYPOINT"][-1]) == ["vllm-ling", "serve"]
    env = " ".join(values["ENV"])
    assert "VLLM_LING_HUMMING_CACHE=/cache/humming" in env and "HF_HOME=/cache/huggingface" in env


def test_copied_files_exist_and_survive_the_dockerignore():
    patterns = [p.strip() for p in (REPO / ".dockerignore").read_text().splitlines()
                if p.strip() and not p.startswith("#")]

    def ignored(path: str) -> bool:
        state = False
        for pattern in patterns:
            negate = pattern.startswith("!")
            pat = pattern[1:] if negate else pattern
            base = pat.rstrip("/")
            if fnmatch.fnmatch(path, pat) or path == base or path.startswith(base + "/"):
                state = not negate
        return state

    sources = []
    for word, rest in instructions():
        if word == "COPY":
            parts = [p for p in rest.split() if not p.startswith("--")]
            sources += parts[:-1]
    assert sources, "no COPY found"
    for src in sources:
        assert (REPO / src).exists(), f"COPY source {src} missing"
        assert not ignored(src), f"COPY source {src} is excluded by the root .dockerignore"
