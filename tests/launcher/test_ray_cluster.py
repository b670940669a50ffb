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
