"""CPU tests of routing: the grouped top-k router against brute force over all group
subsets, the routing-metadata layout against a Python loop (PyTorch, and the Triton kernel in
Triton's CPU interpreter), the weighted top-k sum against a loop."""

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from moe_cases import brute_force_route
from vllm_ling.ops.moe import routing

REPO = Path(__file__).resolve().parents[3]


# ----------------------------------------------------------------------------- routing

@pytest.mark.parametrize("E, n_group, topk_group, top_k", [
    (32, 8, 4, 4), (64, 4, 2, 6), (512, 8, 4, 8), (24, 3, 1, 2),
])
def test_grouped_topk_matches_brute_force(E, n_group, topk_group, top_k):
    g = torch.Generator().manual_seed(E + top_k)
    T = 12
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.5
    w, ids = routing.grouped_topk(logits, top_k, n_group, topk_group, bias, True, 2.5)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    for t in range(T):
        expected = brute_force_route(logits[t].tolist(), bias.tolist(), top_k, n_group,
                                      topk_group, 2.5)
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert set(got) == set(expected)
        for e in got:
            assert math.isclose(got[e], expected[e], rel_tol=1e-6)


def test_bias_selects_but_does_not_weight():
    # expert 3 has the lowest logit but a huge bias: it must be selected, with its own
    # (small) sigmoid score as weight.
    logits = torch.tensor([[2.0, 1.0, 0.5, -4.0]])
    bias = torch.tensor([0.0, 0.0, 0.0, 10.0])
    w, ids = routing.grouped_topk(logits, 2, 1, 1, bias, renormalize=False)
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert set(got) == {3, 0}
    assert math.isclose(got[3], 1 / (1 + math.exp(4.0)), rel_tol=1e-6)
    assert math.isclose(got[0], 1 / (1 + math.exp(-2.0)), rel_tol=1e-6)


def test_router_logits_are_fp32_of_bf16_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    gate = torch.randn(8, 16, generator=g)
    logits = routing.router_logits(x, gate)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), x.double() @ gate.double().t(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- metadata

def _python_align(topk_ids, block_size, num_experts):
    flat = topk_ids.reshape(-1).tolist()
    sorted_ids, expert_ids = [], []
    for e in range(num_experts):
        rows = [i for i, v in enumerate(flat) if v == e]
        if not rows:
            continue
        nblk = -(-len(rows) // block_size)
        sorted_ids += rows + [len(flat)] * (nblk * block_size - len(rows))
        expert_ids += [e] * nblk
    return sorted_ids, expert_ids


ALIGN_CASES = [
    ([[3, 1, 2, 0]], 4, 8),                      # one token, distinct
    ([[5, 5], [5, 5], [5, 5]], 4, 8),            # all on one expert, 2 blocks
    ([[0, 511]] * 4, 16, 512),                   # first and last expert
    ([[1, 2, 3], [1, 2, 4], [1, 3, 4], [1, 2, 3]], 4, 8),
]


def _random_ids(T, k, E, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]).int()


def _check_layout(ids, block, E, sorted_ids, expert_ids, ntp):
    ref_sorted, ref_experts = _python_align(ids, block, E)
    n_slots, n_blocks = routing.moe_align_buffer_sizes(ids.numel(), block, E)
    assert sorted_ids.shape == (n_slots,) and expert_ids.shape == (n_blocks,)
    assert sorted_ids.dtype == expert_ids.dtype == ntp.dtype == torch.int32
    used = int(ntp.item())
    assert used == len(ref_sorted)
    assert sorted_ids[:used].tolist() == ref_sorted
    assert expert_ids[:used // block].tolist() == ref_experts
    assert all(v == ids.numel() for v in sorted_ids[used:].tolist())  # padding sentinel


@pytest.mark.parametrize("ids, block, E", ALIGN_CASES)
def test_align_torch_matches_python_layout(ids, block, E):
    ids = torch.tensor(ids, dtype=torch.int32)
    _check_layout(ids, block, E, *routing.moe_align_block_size_torch(ids, block, E))


@pytest.mark.parametrize("T, block", [(1, 16), (4, 16), (16, 16), (16, 32), (64, 64)])
def test_align_torch_random_ling_routings(T, block):
    ids = _random_ids(T, 8, 512, T * 7 + block)
    _check_layout(ids, block, 512, *routing.moe_align_block_size_torch(ids, block, 512))


def test_align_triton_kernel_in_interpreter():
    """The fused Triton layout kernel, run by Triton's CPU interpreter, against the
    Python layout (same cases as the GPU test)."""
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        # Triton 3.6's interpreter (the GPU image) fails on this kernel's scalar stores; on
        # GPU machines test_moe_humming_gpu compares the compiled kernel instead.
        pytest.skip("interpreter check is for CPU machines")
    code = textwrap.dedent("""
        import json, sys, torch
        from vllm_ling.ops.moe import routing
        cases = json.loads(sys.argv[1])
        out = []
        for ids, block, E in cases:
            t = torch.tensor(ids, dtype=torch.int32)
            s, e, n = routing.moe_align_block_size_triton(t, block, E)
            out.append([s.tolist(), e.tolist(), n.tolist()])
        print(json.dumps(out))
    """)
    cases = [[c[0], c[1], c[2]] for c in ALIGN_CASES]
    cases.append([_random_ids(16, 8, 512, 1).tolist(), 16, 512])
    cases.append([_random_ids(2, 8, 64, 2).tolist(), 8, 64])
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code, json.dumps(cases)], capture_output=True,
                         text=True, env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    for (ids, block, E), (s, e, n) in zip(cases, results):
        ids = torch.tensor(ids, dtype=torch.int32)
        _check_layout(ids, block, E, torch.tensor(s, dtype=torch.int32),
                      torch.tensor(e, dtype=torch.int32), torch.tensor(n, dtype=torch.int32))


def test_align_triton_rejects_large_batches():
    with pytest.raises(ValueError, match="at most"):
        routing.moe_align_block_size_triton(torch.zeros(200, dtype=torch.int32), 16, 512)


def test_weighted_topk_sum_torch_matches_loop():
    g = torch.Generator().manual_seed(21)
    T, k, Hd = 3, 4, 40
    down = torch.randn(T * k, Hd, generator=g).to(torch.bfloat16)
    w = torch.rand(T, k, generator=g)
    ref = torch.stack([sum(w[t, j].double() * down[t * k + j].double() for j in range(k))
                       for t in range(T)])
    got = routing.weighted_topk_sum(down, w, "torch")
    assert ((got.double() - ref).norm() / ref.norm()) < 1e-2  # BF16 weights and output


def test_weighted_topk_sum_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter check is for CPU machines; the GPU test covers the kernel")
    code = textwrap.dedent("""
        import json, torch
        from vllm_ling.ops.moe import routing
        g = torch.Generator().manual_seed(22)
        down = torch.randn(2 * 8, 600, generator=g).to(torch.bfloat16)  # H not a multiple of 512
        w = torch.rand(2, 8, generator=g)
        out = routing.weighted_topk_sum(down, w, "triton")
        ref = (down.float().view(2, 8, 600) * w.unsqueeze(-1)).sum(1)
        print(json.dumps([out.dtype == torch.bfloat16, ((out.float() - ref).norm() / ref.norm()).item()]))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    is_bf16, rel = json.loads(res.stdout.strip().splitlines()[-1])
    assert is_bf16 and rel < 4e-3  # only the final BF16 rounding (2**-9)


def test_auto_hands_only_batches_above_the_triton_limit_to_the_one_launch_aligner():
    """Issue 47: prefill-sized batches take the caller's one-launch aligner (the layer passes vLLM's
    CUDA op); at or below the Triton kernel's limit it is never asked. Off CUDA the small batch runs
    PyTorch here; the layout is the reference's either way."""
    asked = []

    def one_launch(ids, block, E):
        asked.append((ids.numel(), block, E))
        return routing.moe_align_block_size_torch(ids, block, E)

    limit = routing.TRITON_ALIGN_MAX_ASSIGNMENTS
    small, large = _random_ids(limit // 8, 8, 512, 1), _random_ids(limit // 8 + 1, 8, 512, 2)
    _check_layout(small, 16, 512, *routing.moe_align_block_size(small, 16, 512, "auto", one_launch))
    assert asked == []
    _check_layout(large, 16, 512, *routing.moe_align_block_size(large, 16, 512, "auto", one_launch))
    assert asked == [(large.numel(), 16, 512)]
    # an explicit implementation is served as asked
    routing.moe_align_block_size(large, 16, 512, "torch", one_launch)
    assert len(asked) == 1
