"""The Ray cluster around a multi-node server: wait for the nodes, then serve and watch them.

Used by ``vllm-ling-ray head`` (docker/multinode/vllm-ling-ray.sh, the Helm chart's leader):

    python3 -m vllm_ling.launcher.ray_cluster wait --nodes N --timeout S [--workers A,B]
        exit 0 once N nodes are alive; after S seconds exit 2 naming the missing nodes (the
        --workers addresses, or under a LeaderWorkerSet its worker pods, that never joined).
    python3 -m vllm_ling.launcher.ray_cluster serve -- vllm-ling serve ...
        run the server as a child while polling the cluster; when a node that was alive dies,
        log which one (id and address), stop the server and exit 1. vLLM itself only says
        "RayWorkerProc rank=[1] died unexpectedly" and its API server then exits with 0.

Both connect to the cluster this host belongs to (``RAY_ADDRESS`` or ``ray start``'s local
record) as a Ray driver.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

POLL_S = 2.0
STOP_GRACE_S = 30.0
PREFIX = "vllm-ling-ray"


def say(message: str) -> None:
    print(f"{PREFIX}: {message}", file=sys.stderr, flush=True)


def connect() -> None:
    import ray

    if not ray.is_initialized():
        ray.init(address=os.environ.get("RAY_ADDRESS", "auto"), logging_level="ERROR",
                 log_to_driver=False)


def nodes() -> dict[str, dict]:
    """Node id -> {"alive", "address"} for every node the cluster has seen."""
    import ray

    return {n["NodeID"]: {"alive": bool(n["Alive"]), "address": n["NodeManagerAddress"]}
            for n in ray.nodes()}


def describe(node_id: str, node: dict) -> str:
    return f"{node['address']} (node {node_id[:12]})"


def lws_worker_names(env: dict[str, str]) -> list[str]:
    """The worker pods' DNS names in a LeaderWorkerSet group, from the leader's LWS variables:
    leader ``<lws>-<group>.<svc>...``, worker i ``<lws>-<group>-<i>.<svc>...``."""
    leader, size = env.get("LWS_LEADER_ADDRESS", ""), env.get("LWS_GROUP_SIZE", "")
    if "." not in leader or not size.isdigit():
        return []
    first, rest = leader.split(".", 1)
    return [f"{first}-{i}.{rest}" for i in range(1, int(size))]


def resolve(name: str) -> str:
    """A worker's address as Ray reports it (names that do not resolve yet stay names)."""
    import socket

    try:
        return socket.gethostbyname(name)
    except OSError:
        return name


def missing_nodes(seen: dict[str, dict], expected: int, workers: list[str]) -> str:
    """What is missing, in words: the named workers that have no alive node, or a count."""
    alive = [n["address"] for n in seen.values() if n["alive"]]
    absent = [w for w in workers if resolve(w) not in alive]
    joined = ", ".join(sorted(alive)) or "none"
    if absent:
        return f"missing {', '.join(absent)} (joined: {joined})"
    return f"missing {expected - len(alive)} node(s) (joined: {joined}; pass --workers to name them)"


def wait_for_nodes(expected: int, timeout_s: float, workers: list[str]) -> int:
    deadline = time.monotonic() + timeout_s
    connect()
    while True:
        seen = nodes()
        alive = sum(n["alive"] for n in seen.values())
        say(f"{alive}/{expected} Ray nodes alive")
        if alive >= expected:
            return 0
        if time.monotonic() >= deadline:
            say(f"error: only {alive} of {expected} Ray nodes joined within {timeout_s:g} s: "
                f"{missing_nodes(seen, expected, workers)}; check the workers' --head address, "
                "VLLM_HOST_IP and the firewall (the Ray port)")
            return 2
        time.sleep(POLL_S)


def lost_nodes(before: dict[str, dict]) -> list[str]:
    """Nodes alive in ``before`` that are now dead or gone (the head going down counts too)."""
    try:
        now = nodes()
    except Exception as exc:  # noqa: BLE001 -- the GCS itself is unreachable: the head is gone
        return [f"the Ray head (GCS unreachable: {exc.__class__.__name__})"]
    return [describe(i, n) for i, n in before.items()
            if n["alive"] and not now.get(i, {}).get("alive", False)]


def stop(child: subprocess.Popen) -> int:
    if child.poll() is None:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(STOP_GRACE_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()
    return child.returncode


def serve_and_watch(argv: list[str]) -> int:
    connect()
    before = nodes()
    child = subprocess.Popen(argv)
    stopping = False

    def forward(signum, _frame):  # container stop: the server shuts down, its exit code stands
        nonlocal stopping
        stopping = True
        if child.poll() is None:
            child.send_signal(signum)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)
    while True:
        try:
            rc = child.wait(POLL_S)
        except subprocess.TimeoutExpired:
            rc = None
        if stopping:
            # a requested stop: nodes may go away meanwhile (the Ray head's own processes got the
            # same signal), and asking the GCS then blocks for a minute; the server's code stands
            if rc is not None:
                return rc
            continue
        lost = lost_nodes(before)
        if lost:
            say(f"error: lost Ray node(s) while serving: {'; '.join(lost)}; stopping the server")
            stop(child)
            return 1
        if rc is not None:
            if rc == 0:  # vLLM exits 0 after its engine died; nobody asked it to stop
                say("error: the server exited on its own (exit code 0); see its log above")
                return 1
            return rc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m vllm_ling.launcher.ray_cluster")
    sub = parser.add_subparsers(dest="command", required=True)
    wait = sub.add_parser("wait", help="wait until the expected number of Ray nodes is alive")
    wait.add_argument("--nodes", type=int, required=True)
    wait.add_argument("--timeout", type=float, required=True)
    wait.add_argument("--workers", default="", help="comma-separated worker addresses or host "
                      "names, to name the missing ones (default: the LeaderWorkerSet's workers)")
    serve = sub.add_parser("serve", help="run the server command, stop it if a Ray node is lost")
    serve.add_argument("server", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.command == "wait":
        workers = ([w.strip() for w in args.workers.split(",") if w.strip()]
                   or lws_worker_names(dict(os.environ)))
        return wait_for_nodes(args.nodes, args.timeout, workers)
    server = args.server[1:] if args.server[:1] == ["--"] else args.server
    if not server:
        parser.error("serve needs the server command after --")
    return serve_and_watch(server)


if __name__ == "__main__":
    sys.exit(main())
