"""vllm-ling-ray's cluster helper without a cluster: naming missing workers (the real head
timeout and node loss run in tests/deploy/test_ray_two_nodes.py)."""

from __future__ import annotations

from vllm_ling.launcher import ray_cluster


def test_leaderworkerset_worker_names_follow_the_leaders_address():
    env = {"LWS_LEADER_ADDRESS": "ling-vllm-ling-0.ling-vllm-ling.serving", "LWS_GROUP_SIZE": "3"}
    assert ray_cluster.lws_worker_names(env) == ["ling-vllm-ling-0-1.ling-vllm-ling.serving",
                                                 "ling-vllm-ling-0-2.ling-vllm-ling.serving"]
    assert ray_cluster.lws_worker_names({"LWS_LEADER_ADDRESS": "10.0.0.1"}) == []


def test_missing_nodes_names_the_workers_without_an_alive_node():
    seen = {"a" * 56: {"alive": True, "address": "127.0.0.2"},
            "b" * 56: {"alive": False, "address": "127.0.0.3"}}
    assert (ray_cluster.missing_nodes(seen, 3, ["127.0.0.3", "no-such-host.invalid"])
            == "missing 127.0.0.3, no-such-host.invalid (joined: 127.0.0.2)")
    assert "missing 1 node(s) (joined: 127.0.0.2" in ray_cluster.missing_nodes(seen, 2, [])


def test_a_requested_stop_returns_the_servers_code_without_asking_the_cluster(monkeypatch):
    """SIGTERM to the head's process group reaches the Ray head's own processes too: asking the GCS
    for its nodes then blocks for about a minute (the PP=2 two-node test's teardown waited 60 s for
    it). After a requested stop the watcher waits for the server alone and returns its code."""
    import os
    import signal
    import sys
    import threading

    asked_after_stop = []
    stopped = threading.Event()

    def nodes():
        if stopped.is_set():
            asked_after_stop.append(True)
            raise ConnectionError("GCS unreachable")  # what a dead head gives, after its timeout
        return {"a" * 56: {"alive": True, "address": "127.0.0.2"}}

    monkeypatch.setattr(ray_cluster, "connect", lambda: None)
    monkeypatch.setattr(ray_cluster, "nodes", nodes)
    monkeypatch.setattr(ray_cluster, "POLL_S", 0.1)
    server = [sys.executable, "-c", "import signal, sys, time; "
              "signal.signal(signal.SIGTERM, lambda *a: (time.sleep(0.5), sys.exit(0))); time.sleep(30)"]

    def stop_request():
        stopped.set()
        os.kill(os.getpid(), signal.SIGTERM)

    old = signal.getsignal(signal.SIGTERM), signal.getsignal(signal.SIGINT)
    timer = threading.Timer(1.0, stop_request)
    timer.start()
    try:
        rc = ray_cluster.serve_and_watch(server)
    finally:
        timer.cancel()
        signal.signal(signal.SIGTERM, old[0])
        signal.signal(signal.SIGINT, old[1])
    assert rc == 0 and asked_after_stop == []
