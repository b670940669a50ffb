"""docker/multinode: the two-Spark scripts parse, and vllm-ling-ray refuses bad usage."""

from __future__ import annotations

import os

import pytest

from ._tools import DOCKER_DIR, run

SCRIPTS = sorted((DOCKER_DIR / "multinode").glob("*.sh"))


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_parse_and_are_executable(script):
    assert os.access(script, os.X_OK), f"{script.name} is not executable"
    result = run(["bash", "-n", str(script)])
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("args,message", [
    ([], "usage"),
    (["head", "--nodes", "1"], "--nodes N with N >= 2"),
    (["worker"], "--head"),
    (["head", "--bogus"], "unknown option"),
])
def test_vllm_ling_ray_usage_errors(args, message):
    env = dict(os.environ, VLLM_LING_RAY_NUM_GPUS="1")
    result = run(["bash", str(DOCKER_DIR / "multinode" / "vllm-ling-ray.sh"), *args], env=env)
    assert result.returncode == 2
    assert message in result.stderr


def test_host_scripts_require_the_env_file(tmp_path):
    env = dict(os.environ, VLLM_LING_SPARK_ENV=str(tmp_path / "spark.env"))
    result = run(["bash", str(DOCKER_DIR / "multinode" / "start-worker.sh")], env=env)
    assert result.returncode == 2
    assert "spark.env.example" in result.stderr


def test_env_example_names_every_variable_the_scripts_need():
    example = (DOCKER_DIR / "multinode" / "spark.env.example").read_text()
    common = (DOCKER_DIR / "multinode" / "common.sh").read_text()
    required = common.split("for v in ", 1)[1].split(";", 1)[0].split()
    for name in required:
        assert f"{name}=" in example, name
