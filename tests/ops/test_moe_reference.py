"""CPU tests of the Ling MoE reference, routing metadata and the humming cache plumbing.

Each check compares against an independently written computation: brute force over all
group subsets for the router, a per-token Python loop for the block, hand-computed values
for the clamp, a Python loop for the routing-metadata layout.
"""

import itertools
import json
import math
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from vllm_ling.ops import moe
from vllm_ling.ops.mxfp4 import mxfp4_dequantize, mxfp4_quantize

REPO = Path(__file__).resolve().parents[2]
SILU = lambda v: v / (1.0 + math.exp(-v))  # noqa: E731


# ----------------------------------------------------------------------------- clamp

@pytest.mark.parametrize("limit", [None, 0, 0.0])
def test_swiglu_without_limit_is_plain_silu_mul(limit):
    x = torch.tensor([[9.0, -3.0, 20.0, -20.0]])  # gate (9, -3), up (20, -20)
    got = moe.swiglu(x, limit)
    assert torch.allclose(got, torch.tensor([[SILU(9.0) * 20.0, SILU(-3.0) * -20.0]]))


def test_swiglu_clamp_gate_input_matches_vllm_fused_moe_semantics():
    # gate 9 -> min(9, 4) = 4 -> silu(4); up 20 -> 4; gate -3 unclamped; up -20 -> -4
    x = torch.tensor([[9.0, -3.0, 20.0, -20.0]])
    got = moe.swiglu(x, 4.0, moe.CLAMP_GATE_INPUT)
    expected = [SILU(4.0) * 4.0, SILU(-3.0) * -4.0]
    assert torch.allclose(got, torch.tensor([expected]), rtol=1e-6)


def test_swiglu_clamp_gate_output_matches_swiglu_step():
    # silu(9) = 8.9990 -> min(., 4) = 4; silu(4.05) = 3.98 stays (< 4) -- differs from
    # the gate-input mode, where min(4.05, 4) = 4 -> silu(4) = 3.928
    x = torch.tensor([[9.0, 4.05, 1.0, 1.0]])
    got = moe.swiglu(x, 4.0, moe.CLAMP_GATE_OUTPUT)
    assert torch.allclose(got, torch.tensor([[4.0, SILU(4.05)]]), rtol=1e-6)
    pre = moe.swiglu(x, 4.0, moe.CLAMP_GATE_INPUT)
    assert torch.allclose(pre, torch.tensor([[SILU(4.0), SILU(4.0)]]), rtol=1e-6)


def test_swiglu_rejects_bad_mode_and_negative_limit():
    x = torch.zeros(1, 4)
    with pytest.raises(ValueError, match="clamp"):
        moe.swiglu(x, 1.0, "both")
    with pytest.raises(ValueError, match="swiglu_limit"):
        moe.swiglu(x, -1.0)


def test_layer_swiglu_limit_reads_like_vllm():
    limits = [0, 0, 4, None, 7.5]
    assert [moe.layer_swiglu_limit(limits, i) for i in range(6)] == [None, None, 4.0, None, 7.5, None]
    assert moe.layer_swiglu_limit(None, 0) is None


def _eval_c_expr(expr: str, a: float, b: float) -> float:
    py = re.sub(r"(\d\.?\d*(?:e[-+]?\d+)?)f\b", r"\1", expr)
    return eval(py, {"fminf": min, "fmaxf": max, "expf": math.exp, "a": a, "b": b})  # noqa: S307


@pytest.mark.parametrize("limit", [None, 4.0, 7.0])
@pytest.mark.parametrize("clamp", [moe.CLAMP_GATE_INPUT, moe.CLAMP_GATE_OUTPUT])
def test_humming_activation_expression_equals_reference(limit, clamp):
    expr = moe.swiglu_activation_expr(limit, clamp)
    for a, b in [(9.0, 20.0), (4.05, -9.0), (-3.0, 2.0), (0.5, -0.25), (-30.0, 8.0)]:
        ref = moe.swiglu(torch.tensor([[a, b]], dtype=torch.float64), limit, clamp).item()
        assert math.isclose(_eval_c_expr(expr, a, b), ref, rel_tol=1e-12, abs_tol=1e-12)


# ----------------------------------------------------------------------------- routing

def _brute_force_route(logits_row, bias_row, top_k, n_group, topk_group, rsf, renorm=True):
    """Enumerate every set of topk_group groups; keep the one with the largest total group
    score (group score = sum of its two largest biased scores), then the top_k biased
    experts inside; weights are the unbiased sigmoid scores."""
    E = len(logits_row)
    per = E // n_group
    score = [1.0 / (1.0 + math.exp(-v)) for v in logits_row]
    biased = [s + b for s, b in zip(score, bias_row)]
    group_score = []
    for g in range(n_group):
        members = sorted(biased[g * per:(g + 1) * per], reverse=True)
        group_score.append(sum(members[:2]))
    best = max(itertools.combinations(range(n_group), topk_group),
               key=lambda groups: sum(group_score[g] for g in groups))
    candidates = [e for g in best for e in range(g * per, (g + 1) * per)]
    chosen = sorted(candidates, key=lambda e: biased[e], reverse=True)[:top_k]
    weights = [score[e] for e in chosen]
    if renorm:
        total = sum(weights)
        weights = [w / total for w in weights]
    return {e: w * rsf for e, w in zip(chosen, weights)}


@pytest.mark.parametrize("E, n_group, topk_group, top_k", [
    (32, 8, 4, 4), (64, 4, 2, 6), (512, 8, 4, 8), (24, 3, 1, 2),
])
def test_grouped_topk_matches_brute_force(E, n_group, topk_group, top_k):
    g = torch.Generator().manual_seed(E + top_k)
    T = 12
    logits = torch.randn(T, E, generator=g, dtype=torch.float64) * 2
    bias = torch.randn(E, generator=g, dtype=torch.float64) * 0.5
    w, ids = moe.grouped_topk(logits, top_k, n_group, topk_group, bias, True, 2.5)
    assert w.dtype == torch.float32 and ids.dtype == torch.int32
    for t in range(T):
        expected = _brute_force_route(logits[t].tolist(), bias.tolist(), top_k, n_group,
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
    w, ids = moe.grouped_topk(logits, 2, 1, 1, bias, renormalize=False)
    got = dict(zip(ids[0].tolist(), w[0].tolist()))
    assert set(got) == {3, 0}
    assert math.isclose(got[3], 1 / (1 + math.exp(4.0)), rel_tol=1e-6)
    assert math.isclose(got[0], 1 / (1 + math.exp(-2.0)), rel_tol=1e-6)


def test_router_logits_are_fp32_of_bf16_inputs():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(3, 16, generator=g).to(torch.bfloat16)
    gate = torch.randn(8, 16, generator=g)
    logits = moe.router_logits(x, gate)
    assert logits.dtype == torch.float32
    assert torch.allclose(logits.double(), x.double() @ gate.double().t(), rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- block

def _make_block(E=16, H=64, I=32, S=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(E, 2 * I, H, generator=g) * 0.2
    w2 = torch.randn(E, H, I, generator=g) * 0.2
    w13_q, w13_s = mxfp4_quantize(w13)
    w2_q, w2_s = mxfp4_quantize(w2)
    return dict(
        gate_weight=torch.randn(E, H, generator=g) * 0.3,
        expert_bias=torch.randn(E, generator=g) * 0.1,
        w13=w13_q, w13_scale=w13_s, w2=w2_q, w2_scale=w2_s,
        shared_gate_up=torch.randn(2 * S, H, generator=g) * 0.2,
        shared_down=torch.randn(H, S, generator=g) * 0.2,
    )


def _per_token_loop(x, blk, cfg, routed_limit, shared_limit):
    """Independent per-token computation in float64 with Python-level routing."""
    w13 = mxfp4_dequantize(blk["w13"], blk["w13_scale"]).double()
    w2 = mxfp4_dequantize(blk["w2"], blk["w2_scale"]).double()
    out = []
    for t in range(x.shape[0]):
        xt = x[t].double()
        logits = (blk["gate_weight"].double() @ xt).tolist()
        routes = _brute_force_route(logits, blk["expert_bias"].tolist(), cfg.top_k, cfg.n_group,
                                    cfg.topk_group, cfg.routed_scaling_factor)
        acc = torch.zeros_like(xt)
        for e, weight in routes.items():
            h = w13[e] @ xt
            I = h.shape[0] // 2
            gate, up = h[:I].tolist(), h[I:].tolist()
            act = []
            for gv, uv in zip(gate, up):
                if routed_limit:
                    gv, uv = min(gv, routed_limit), max(min(uv, routed_limit), -routed_limit)
                act.append(SILU(gv) * uv)
            acc += weight * (w2[e] @ torch.tensor(act, dtype=torch.float64))
        hs = blk["shared_gate_up"].double() @ xt
        S = hs.shape[0] // 2
        sact = []
        for gv, uv in zip(hs[:S].tolist(), hs[S:].tolist()):
            a = SILU(gv)
            if shared_limit:
                a, uv = min(a, shared_limit), max(min(uv, shared_limit), -shared_limit)
            sact.append(a * uv)
        acc += blk["shared_down"].double() @ torch.tensor(sact, dtype=torch.float64)
        out.append(acc)
    return torch.stack(out)


@pytest.mark.parametrize("routed_limit, shared_limit", [(None, None), (0.5, 0.3)])
def test_block_reference_matches_per_token_loop(routed_limit, shared_limit):
    cfg = moe.LingMoEConfig(num_experts=16, top_k=4, n_group=4, topk_group=2,
                            routed_scaling_factor=2.5, hidden_size=64,
                            moe_intermediate_size=32, shared_intermediate_size=32)
    blk = _make_block()
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    got = moe.moe_block_reference(x, cfg, routed_swiglu_limit=routed_limit,
                                  shared_swiglu_limit=shared_limit, **blk)
    ref = _per_token_loop(x, blk, cfg, routed_limit, shared_limit)
    assert got.dtype == torch.float32
    rel = (got.double() - ref).norm() / ref.norm()
    assert rel < 1e-5, rel  # both float-accurate; only fp32 vs fp64 rounding differs
    if routed_limit:
        # the clamp must actually bite in this case, or the test proves nothing
        unclamped = moe.moe_block_reference(x, cfg, **blk)
        assert (unclamped - got).norm() / got.norm() > 1e-2


def test_experts_reference_mxfp4_equals_dequantized_weights():
    blk = _make_block(seed=4)
    x = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    ids = torch.tensor([[0, 15, 3, 3]] * 3 + [[7, 7, 7, 7]] * 3, dtype=torch.int32)
    w = torch.rand(6, 4, generator=torch.Generator().manual_seed(6))
    a = moe.experts_reference(x, blk["w13"], blk["w2"], w, ids, 0.5,
                              w13_scale=blk["w13_scale"], w2_scale=blk["w2_scale"])
    b = moe.experts_reference(x, mxfp4_dequantize(blk["w13"], blk["w13_scale"]),
                              mxfp4_dequantize(blk["w2"], blk["w2_scale"]), w, ids, 0.5)
    assert torch.equal(a, b)
    with pytest.raises(ValueError, match="scales"):
        moe.experts_reference(x, blk["w13"], blk["w2"], w, ids)


def test_fake_quant_fp8_keeps_row_max_and_relative_error():
    x = torch.randn(4, 256, generator=torch.Generator().manual_seed(2)) * 3
    q = moe.fake_quant_fp8_per_token(x)
    assert torch.allclose(q.abs().amax(-1), x.abs().amax(-1), rtol=1e-6)
    assert ((q - x).norm() / x.norm()) < 0.05  # e4m3 has 3 mantissa bits


def test_config_from_hf_config_file():
    path = REPO / "vllm_ling" / "data" / "ling3_flash_fp4_config.json"  # shipped with the package
    cfg = moe.LingMoEConfig.from_hf_config(json.loads(path.read_text()))
    assert (cfg.num_experts, cfg.top_k, cfg.n_group, cfg.topk_group) == (512, 8, 8, 4)
    assert (cfg.hidden_size, cfg.moe_intermediate_size, cfg.routed_scaling_factor) == (2560, 768, 2.5)


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
    n_slots, n_blocks = moe.moe_align_buffer_sizes(ids.numel(), block, E)
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
    _check_layout(ids, block, E, *moe.moe_align_block_size_torch(ids, block, E))


@pytest.mark.parametrize("T, block", [(1, 16), (4, 16), (16, 16), (16, 32), (64, 64)])
def test_align_torch_random_ling_routings(T, block):
    ids = _random_ids(T, 8, 512, T * 7 + block)
    _check_layout(ids, block, 512, *moe.moe_align_block_size_torch(ids, block, 512))


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
        from vllm_ling.ops import moe
        cases = json.loads(sys.argv[1])
        out = []
        for ids, block, E in cases:
            t = torch.tensor(ids, dtype=torch.int32)
            s, e, n = moe.moe_align_block_size_triton(t, block, E)
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
        moe.moe_align_block_size_triton(torch.zeros(200, dtype=torch.int32), 16, 512)


# ----------------------------------------------------------------------------- humming plumbing

def test_humming_status_on_cpu_machine_says_why():
    ok, reason = moe.humming_status()
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    assert ok is False
    assert "humming" in reason or "CUDA" in reason


def test_humming_experts_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("this check is for machines without CUDA")
    t = moe.random_mxfp4_experts(4, 64, 32, device="cpu")
    with pytest.raises(moe.HummingUnavailableError):
        moe.HummingMxfp4Experts(**t)


def test_cache_dir_env_and_default(monkeypatch, tmp_path):
    from vllm_ling.ops import humming_cache as hc

    monkeypatch.delenv(hc.HUMMING_ENV_CACHE, raising=False)
    monkeypatch.delenv(hc.HUMMING_ENV_TMP, raising=False)
    monkeypatch.delenv(hc.ENV_CACHE, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert hc.humming_cache_root() == tmp_path / "xdg" / "vllm-ling" / "humming"
    monkeypatch.setenv(hc.ENV_CACHE, str(tmp_path / "mine"))
    kernels = hc.configure_humming_cache()
    assert kernels == tmp_path / "mine" / "kernels" and kernels.is_dir()
    assert os.environ[hc.HUMMING_ENV_CACHE] == str(kernels)
    assert os.environ[hc.HUMMING_ENV_TMP] == str(tmp_path / "mine" / "tmp")
    (kernels / "abc").mkdir()
    (kernels / "abc" / "kernel.cubin").write_bytes(b"x")
    assert hc.count_cached_kernels(kernels) == 1


def test_user_humming_cache_dir_is_respected(monkeypatch, tmp_path):
    from vllm_ling.ops import humming_cache as hc

    monkeypatch.delenv(hc.ENV_CACHE, raising=False)
    monkeypatch.delenv(hc.HUMMING_ENV_TMP, raising=False)
    monkeypatch.setenv(hc.HUMMING_ENV_CACHE, str(tmp_path / "hc" / "cache"))
    assert hc.configure_humming_cache() == tmp_path / "hc" / "cache"
    assert os.environ[hc.HUMMING_ENV_TMP] == str(tmp_path / "hc" / "tmp")


def test_compile_lock_excludes_another_process(tmp_path):
    from vllm_ling.ops import humming_cache as hc

    probe = textwrap.dedent("""
        import fcntl, sys
        fh = open(sys.argv[1], "a+")
        try:
            fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            print("acquired")
        except BlockingIOError:
            print("blocked")
    """)
    with hc.compile_lock(tmp_path) as path:
        inside = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                                text=True, timeout=60).stdout.strip()
    after = subprocess.run([sys.executable, "-c", probe, str(path)], capture_output=True,
                           text=True, timeout=60).stdout.strip()
    assert (inside, after) == ("blocked", "acquired")


def test_weighted_topk_sum_torch_matches_loop():
    g = torch.Generator().manual_seed(21)
    T, k, Hd = 3, 4, 40
    down = torch.randn(T * k, Hd, generator=g).to(torch.bfloat16)
    w = torch.rand(T, k, generator=g)
    ref = torch.stack([sum(w[t, j].double() * down[t * k + j].double() for j in range(k))
                       for t in range(T)])
    got = moe.weighted_topk_sum(down, w, "torch")
    assert ((got.double() - ref).norm() / ref.norm()) < 1e-2  # BF16 weights and output


def test_weighted_topk_sum_triton_kernel_in_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter check is for CPU machines; the GPU test covers the kernel")
    code = textwrap.dedent("""
        import json, torch
        from vllm_ling.ops import moe
        g = torch.Generator().manual_seed(22)
        down = torch.randn(2 * 8, 600, generator=g).to(torch.bfloat16)  # H not a multiple of 512
        w = torch.rand(2, 8, generator=g)
        out = moe.weighted_topk_sum(down, w, "triton")
        ref = (down.float().view(2, 8, 600) * w.unsqueeze(-1)).sum(1)
        print(json.dumps([out.dtype == torch.bfloat16, ((out.float() - ref).norm() / ref.norm()).item()]))
    """)
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    is_bf16, rel = json.loads(res.stdout.strip().splitlines()[-1])
    assert is_bf16 and rel < 4e-3  # only the final BF16 rounding (2**-9)
