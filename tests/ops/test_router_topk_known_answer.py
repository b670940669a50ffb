"""The router top-k known answers (vllm_ling.ops.known_answer.router_topk) on the CPU: the
plain-PyTorch reference passes them, an independent float64 rewrite of Ling's routing passes them,
and each way of misreading the routing fails them, named, for Ling's configuration and the tiny one.
The kernel itself runs them on the GPU (tests/ops/test_router_topk_gpu.py)."""

from __future__ import annotations

import json
from importlib import resources

import pytest
import torch

import known_answer_faults as faults
from vllm_ling.models.tiny_checkpoint import routable_variant
from vllm_ling.ops.known_answer import router_topk as K
from vllm_ling.ops.moe.routing import grouped_topk


def _config(config_file: str) -> dict:
    return json.loads(resources.files("vllm_ling").joinpath(f"data/{config_file}").read_text())


def _routing(c: dict) -> K.Routing:
    return K.Routing(c["num_experts"], c["n_group"], c["topk_group"], c["num_experts_per_tok"], True,
                     c["routed_scaling_factor"])


# Ling's, the tiny model's, the routable tiny model's (two groups keeping one: only the flip group is
# left out of the decoy token's kept groups, the layout the first GPU run of the cut tripped on), and
# four groups keeping three (one group left out, more than two groups)
ROUTINGS = {"ling": _routing(_config("ling3_flash_fp4_config.json")),
            "tiny": _routing(_config("ling3_tiny_fp4_config.json")),
            "routable": _routing(routable_variant(_config("ling3_tiny_fp4_config.json"))),
            "four_keep_three": K.Routing(128, 4, 3, 6, True, 2.5)}
FAULTS = ("no_bias", "no_groups", "group_max", "biased_weights", "no_renormalize", "no_scale")


@pytest.fixture(params=sorted(ROUTINGS))
def routing(request) -> K.Routing:
    return ROUTINGS[request.param]


def test_the_reference_in_fp32_passes(routing):
    def route(logits, bias):
        return grouped_topk(logits, routing.top_k, routing.n_group, routing.topk_group, bias, routing.renormalize,
                            routing.scale)

    result = K.check_router_topk(route, "reference fp32", routing)
    assert result.passed and result.cases == 3 and result.max_error < K.TOPK_RTOL / 10, result.message()


def test_an_independent_rewrite_passes(routing):
    # the fault injector with no fault: its own float64 implementation, sharing no code with the reference
    result = K.check_router_topk(faults.misrouting("none", routing), "rewrite", routing)
    assert result.passed, result.message()


@pytest.mark.parametrize("fault", FAULTS)
def test_each_misreading_of_the_routing_fails_named(routing, fault):
    result = K.check_router_topk(faults.misrouting(fault, routing), fault, routing)
    assert not result.passed and result.max_error > 100 * K.TOPK_RTOL
    assert "tokens routed to other experts or weights" in result.failing_inputs[0]


@pytest.mark.parametrize("fault", ["no_bias", "no_groups", "group_max", "biased_weights"])
def test_the_designed_tokens_alone_catch_the_routing_faults(routing, fault):
    """The decoy-group and bias-flip tokens fail each misreading by construction, whatever the
    random tokens happen to hold."""
    problem = K.router_topk_problem(routing)
    [designed] = [c for c in problem.cases if c.label.startswith("decoy group")]
    weights, ids = faults.misrouting(fault, routing)(designed.inputs["logits"], problem.bias)
    rows = ((K.dense_weights(weights, ids, routing.num_experts) - designed.reference).norm(dim=-1)
            / designed.reference.norm(dim=-1))
    assert rows.max() > 0.1


def test_random_tokens_leave_no_near_tie_to_decide(routing):
    problem = K.router_topk_problem(routing)
    for case in problem.cases:
        assert (K.decision_margins(case.inputs["logits"], problem.bias, routing) > K.MARGIN).all(), case.label


def test_a_router_that_raises_fails_the_check_named():
    def route(logits, bias):
        raise RuntimeError("grouped top-k cannot route (1, 512)")

    result = K.check_router_topk(route, "raises", ROUTINGS["ling"])
    assert not result.passed and "raised RuntimeError: grouped top-k cannot route" in result.failing_inputs[0]


def test_a_picked_expert_listed_twice_is_a_wrong_row():
    r = ROUTINGS["tiny"]
    ids = torch.tensor([[3, 3]])
    assert K.dense_weights(torch.tensor([[0.5, 0.5]]), ids, r.num_experts)[0, 3] == 1.0
