"""vllm_ling.ops.kda against an independent step-by-step KDA written here from the math.

The naive reference below shares no code with ops/kda.py: float64, Python loops over
sequences, tokens and heads, the state kept in the textbook orientation S[K, V]
(ops and vLLM store S^T, [V, K]). Tolerances: ops compute in float32; after a few
hundred steps of the recurrence outputs and states agree with the float64 loop to
about 1e-5, so 2e-4 (absolute, values of order 1) leaves room without hiding a
wrong decay, sign, layout or state hand-over (those give errors of order 0.1-1).
"""

from __future__ import annotations

import math

import pytest
import torch

from vllm_ling.ops import kda

ATOL = 2e-4
H, DK, DV, W = 3, 8, 8, 4  # heads, key dim, value dim (== DK in Ling), conv width


# ----------------------------------------------------------- naive reference


def naive_gate(raw, a_log, bias, lower_bound):
    """Per element, straight from the formulas; raw [T, H*D] -> [T, H, D] float64."""
    t_len, hd = raw.shape
    d = hd // a_log.numel()
    out = torch.empty(t_len, a_log.numel(), d, dtype=torch.float64)
    for t in range(t_len):
        for h in range(a_log.numel()):
            a = math.exp(float(a_log.flatten()[h]))
            for c in range(d):
                x = float(raw[t, h * d + c]) + float(bias[h * d + c])
                if lower_bound is not None:
                    out[t, h, c] = lower_bound / (1.0 + math.exp(-a * x))
                else:
                    sp = x if x > 20.0 else math.log1p(math.exp(x))
                    out[t, h, c] = -a * sp
    return out


def naive_conv(x, weight, history):
    """One sequence: x [T, C], weight [C, W], history [W-1, C] (oldest first).
    Returns (silu(conv) [T, C], new history = last W-1 inputs)."""
    x = x.double()
    buf = torch.cat([history.double(), x], 0)
    width = weight.shape[1]
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        for c in range(x.shape[1]):
            acc = 0.0
            for j in range(width):
                acc += float(weight[c, j]) * float(buf[t + j, c])
            out[t, c] = acc / (1.0 + math.exp(-acc))
    return out, buf[buf.shape[0] - (width - 1):]


def naive_kda(q, k, v, g, beta, state_kv, scale):
    """One sequence, per token and head. q/k/g [T, H, K], v [T, H, V], beta [T, H],
    state_kv [H, K, V] (textbook S). Returns (o [T, H, V], S after every token)."""
    S = state_kv.double().clone()
    o = torch.empty(v.shape, dtype=torch.float64)
    states = []
    for t in range(q.shape[0]):
        for h in range(q.shape[1]):
            qt = q[t, h].double()
            kt = k[t, h].double()
            qt = qt / math.sqrt(float((qt * qt).sum()) + 1e-6) * scale
            kt = kt / math.sqrt(float((kt * kt).sum()) + 1e-6)
            for i in range(S.shape[1]):  # decay each key row
                S[h, i, :] *= math.exp(float(g[t, h, i]))
            pred = torch.zeros(S.shape[2], dtype=torch.float64)
            for i in range(S.shape[1]):
                pred += kt[i] * S[h, i, :]
            delta = float(beta[t, h]) * (v[t, h].double() - pred)
            for i in range(S.shape[1]):
                S[h, i, :] += kt[i] * delta
            out = torch.zeros(S.shape[2], dtype=torch.float64)
            for i in range(S.shape[1]):
                out += qt[i] * S[h, i, :]
            o[t, h] = out
        states.append(S.clone())
    return o, states


def to_vllm_layout(s_kv):
    return s_kv.transpose(-1, -2)


# ------------------------------------------------------------------ inputs


def make_inputs(total, seed=0, lower_bound=-5.0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(total, H, DK, generator=gen)
    k = torch.randn(total, H, DK, generator=gen)
    v = torch.randn(total, H, DV, generator=gen)
    raw_g = torch.randn(total, H * DK, generator=gen)
    a_log = torch.randn(H, generator=gen) * 0.5
    bias = torch.randn(H * DK, generator=gen)
    g = kda.kda_gate(raw_g, a_log, bias, lower_bound=lower_bound)
    beta = torch.rand(total, H, generator=gen)
    return q, k, v, g, beta


def random_state(n, seed=1):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, H, DK, DV, generator=gen) * 0.3  # textbook [K, V]


# ------------------------------------------------------------------- tests


@pytest.mark.parametrize("lower_bound", [-5.0, None])
def test_gate_matches_formula(lower_bound):
    gen = torch.Generator().manual_seed(3)
    raw = torch.randn(5, H * DK, generator=gen) * 8  # reaches the softplus threshold
    a_log = torch.randn(1, 1, H, 1, generator=gen)
    bias = torch.randn(H * DK, generator=gen)
    got = kda.kda_gate(raw.bfloat16(), a_log, bias, lower_bound=lower_bound)
    assert got.dtype == torch.float32 and got.shape == (5, H, DK)
    want = naive_gate(raw.bfloat16().float(), a_log, bias, lower_bound)
    torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
    assert bool((got <= 0).all())
    if lower_bound is not None:
        assert bool((got >= lower_bound).all())


@pytest.mark.parametrize("impl", ["recurrent", "chunked"])
def test_varlen_against_naive(impl):
    lens = [1, 5, 37]  # 37 crosses two chunk boundaries at chunk size 16
    cu = torch.tensor([0, 1, 6, 43])
    q, k, v, g, beta = make_inputs(cu[-1].item())
    s0 = random_state(len(lens))
    scale = DK ** -0.5
    if impl == "recurrent":
        o, final = kda.kda_recurrent(q, k, v, g, beta, to_vllm_layout(s0), cu, scale)
    else:
        o, final = kda.kda_chunked(q, k, v, g, beta, to_vllm_layout(s0), cu, scale)
    for n in range(len(lens)):
        a, b = cu[n].item(), cu[n + 1].item()
        o_ref, states = naive_kda(q[a:b], k[a:b], v[a:b], g[a:b], beta[a:b], s0[n], scale)
        torch.testing.assert_close(o[a:b].double(), o_ref, atol=ATOL, rtol=0)
        torch.testing.assert_close(final[n].double(), to_vllm_layout(states[-1]), atol=ATOL,
                                   rtol=0)


@pytest.mark.parametrize("chunk_size", [4, 7, 16, 64])
def test_chunked_equals_recurrent(chunk_size):
    cu = torch.tensor([0, 90, 91, 150])
    q, k, v, g, beta = make_inputs(150, seed=5, lower_bound=None)  # softplus gate
    s0 = to_vllm_layout(random_state(3, seed=6))
    o_r, f_r = kda.kda_recurrent(q, k, v, g, beta, s0, cu, 0.125)
    o_c, f_c = kda.kda_chunked(q, k, v, g, beta, s0, cu, 0.125, chunk_size=chunk_size)
    torch.testing.assert_close(o_c, o_r, atol=ATOL, rtol=0)
    torch.testing.assert_close(f_c, f_r, atol=ATOL, rtol=0)


def test_strong_decay_does_not_overflow():
    # g near the safe-gate bound for 64 steps: cumulative decay exp(-320) underflows.
    q, k, v, _, beta = make_inputs(64, seed=7)
    g = torch.full((64, H, DK), -4.99)
    s0 = torch.zeros(1, H, DV, DK)
    o, f = kda.kda_chunked(q, k, v, g, beta, s0, torch.tensor([0, 64]), 0.3, chunk_size=64)
    o_r, f_r = kda.kda_recurrent(q, k, v, g, beta, s0, torch.tensor([0, 64]), 0.3)
    assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(f).all())
    torch.testing.assert_close(o, o_r, atol=ATOL, rtol=0)


def test_prefill_then_decode_equals_one_long_prefill():
    """Pool wrappers, vLLM state layout: prefill P tokens, then decode the rest one
    token per step; equals one prefill of everything and the naive loop."""
    total, prefill = 40, 23
    q, k, v, g, beta = make_inputs(total, seed=11)
    scale = DK ** -0.5
    slot = 3
    pool_a = torch.full((5, H, DV, DK), float("nan"))  # stale slots must not leak in
    pool_b = pool_a.clone()
    no_init = torch.tensor([False])
    o_long = kda.kda_prefill_pooled(q, k, v, g, beta, pool_a, torch.tensor([0, total]),
                                    torch.tensor([slot]), no_init, scale)
    o_parts = [kda.kda_prefill_pooled(q[:prefill], k[:prefill], v[:prefill], g[:prefill],
                                      beta[:prefill], pool_b, torch.tensor([0, prefill]),
                                      torch.tensor([slot]), no_init, scale)]
    for t in range(prefill, total):
        sl = slice(t, t + 1)
        o_parts.append(kda.kda_decode_pooled(q[sl], k[sl], v[sl], g[sl], beta[sl], pool_b,
                                             torch.tensor([0, 1]), torch.tensor([slot]), scale))
    o_steps = torch.cat(o_parts)
    o_ref, states = naive_kda(q, k, v, g, beta, torch.zeros(H, DK, DV), scale)
    torch.testing.assert_close(o_steps.double(), o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(o_long.double(), o_ref, atol=ATOL, rtol=0)
    torch.testing.assert_close(pool_b[slot].double(), to_vllm_layout(states[-1]), atol=ATOL,
                               rtol=0)
    torch.testing.assert_close(pool_a[slot], pool_b[slot], atol=ATOL, rtol=0)
    assert bool(pool_b[[0, 1, 2, 4]].isnan().all())  # other slots untouched


def test_prefill_has_initial_state_and_null_slot():
    cu = torch.tensor([0, 6, 10, 13])
    q, k, v, g, beta = make_inputs(13, seed=12)
    s_kv = random_state(3, seed=13)
    pool = torch.zeros(6, H, DV, DK)
    pool[2] = to_vllm_layout(s_kv[0])
    pool[4] = 7.0  # stale state of a slot being reused: must be ignored
    slots = torch.tensor([2, 4, 0])  # third sequence is padding (null block 0)
    has_init = torch.tensor([True, False, True])
    o = kda.kda_prefill_pooled(q, k, v, g, beta, pool, cu, slots, has_init, 0.2)
    o0, st0 = naive_kda(q[:6], k[:6], v[:6], g[:6], beta[:6], s_kv[0], 0.2)
    o1, st1 = naive_kda(q[6:10], k[6:10], v[6:10], g[6:10], beta[6:10],
                        torch.zeros(H, DK, DV), 0.2)
    torch.testing.assert_close(o[:6].double(), o0, atol=ATOL, rtol=0)
    torch.testing.assert_close(o[6:10].double(), o1, atol=ATOL, rtol=0)
    assert bool((o[10:] == 0).all())
    torch.testing.assert_close(pool[2].double(), to_vllm_layout(st0[-1]), atol=ATOL, rtol=0)
    torch.testing.assert_close(pool[4].double(), to_vllm_layout(st1[-1]), atol=ATOL, rtol=0)
    assert bool((pool[0] == 0).all())


def test_spec_decode_recurrence_with_accepted_tokens():
    """Verify windows of S tokens: state after token t goes to slot row[t]; the next
    step resumes from row[a - 1] where a tokens were accepted. Equals running the
    accepted tokens only."""
    num_spec = 3
    width = num_spec + 1
    q, k, v, g, beta = make_inputs(4 * width, seed=21)
    scale = DK ** -0.5
    s_kv = random_state(2, seed=22)
    rows = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    pool = torch.zeros(9, H, DV, DK)
    pool[1], pool[5] = to_vllm_layout(s_kv[0]), to_vllm_layout(s_kv[1])
    cu = torch.tensor([0, width, 2 * width])
    # step 1: both sequences start from their first slot (1 token accepted before)
    o1 = kda.kda_decode_pooled(q[:8], k[:8], v[:8], g[:8], beta[:8], pool, cu, rows, scale,
                               num_accepted_tokens=torch.tensor([1, 1]))
    accepted = [2, 4]
    # step 2: resume after 2 (seq 0) and 4 (seq 1) accepted tokens
    o2 = kda.kda_decode_pooled(q[8:], k[8:], v[8:], g[8:], beta[8:], pool, cu, rows, scale,
                               num_accepted_tokens=torch.tensor(accepted))
    for n in range(2):
        step1 = slice(n * width, (n + 1) * width)
        step2 = slice(8 + n * width, 8 + (n + 1) * width)
        o_ref1, st1 = naive_kda(q[step1], k[step1], v[step1], g[step1], beta[step1], s_kv[n],
                                scale)
        torch.testing.assert_close(o1[step1].double(), o_ref1, atol=ATOL, rtol=0)
        kept = st1[accepted[n] - 1]
        o_ref2, st2 = naive_kda(q[step2], k[step2], v[step2], g[step2], beta[step2], kept,
                                scale)
        torch.testing.assert_close(o2[n * width:(n + 1) * width].double(), o_ref2,
                                   atol=ATOL, rtol=0)
        for t in range(width):
            torch.testing.assert_close(pool[rows[n, t]].double(), to_vllm_layout(st2[t]),
                                       atol=ATOL, rtol=0)


def test_decode_skips_null_slots():
    q, k, v, g, beta = make_inputs(2, seed=31)
    pool = torch.randn(4, H, DV, DK)
    before = pool.clone()
    o = kda.kda_decode_pooled(q, k, v, g, beta, pool, torch.tensor([0, 1, 2]),
                              torch.tensor([0, 2]), 0.3)
    assert bool((o[0] == 0).all())
    assert torch.equal(pool[[0, 1, 3]], before[[0, 1, 3]])
    assert not torch.equal(pool[2], before[2])


# --------------------------------------------------------------- conv tests

C = 6


def conv_inputs(total, seed=40):
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(total, C, generator=gen), torch.randn(C, W, generator=gen) * 0.5)


def test_conv_prefill_varlen_with_initial_state():
    x, weight = conv_inputs(12)
    cu = torch.tensor([0, 2, 9, 12])
    gen = torch.Generator().manual_seed(41)
    # pool in vLLM's default (state_len, dim) layout, handed over transposed like the layer
    pool_sd = torch.randn(5, W - 1 + 2, C, generator=gen)
    pool = pool_sd.transpose(-1, -2)
    initial = pool.clone()
    slots = torch.tensor([1, 3, 4])
    has_init = torch.tensor([True, False, True])
    out = kda.causal_conv1d_prefill(x, weight, None, pool, cu, slots, has_init)
    for n in range(3):
        a, b = cu[n].item(), cu[n + 1].item()
        hist = (initial[slots[n], :, :W - 1].t() if has_init[n]
                else torch.zeros(W - 1, C))
        ref, new_hist = naive_conv(x[a:b], weight, hist)
        torch.testing.assert_close(out[a:b].double(), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(pool_sd[slots[n], :W - 1].double(), new_hist, atol=1e-6,
                                   rtol=0)
        # columns beyond W-1 (speculative room) are not touched by prefill
        torch.testing.assert_close(pool[slots[n], :, W - 1:], initial[slots[n], :, W - 1:])
    torch.testing.assert_close(pool[[0, 2]], initial[[0, 2]])


def test_conv_prefill_then_decode_equals_long_prefill():
    x, weight = conv_inputs(15, seed=42)
    bias = torch.randn(C)
    pool = torch.zeros(3, C, W - 1)
    out = [kda.causal_conv1d_prefill(x[:9], weight, bias, pool, torch.tensor([0, 9]),
                                     torch.tensor([2]), torch.tensor([False]))]
    for t in range(9, 15):
        out.append(kda.causal_conv1d_update(x[t:t + 1], weight, bias, pool, torch.tensor([2])))
    pool_long = torch.zeros(3, C, W - 1)
    long = kda.causal_conv1d_prefill(x, weight, bias, pool_long, torch.tensor([0, 15]),
                                     torch.tensor([2]), torch.tensor([False]))
    torch.testing.assert_close(torch.cat(out), long, atol=1e-6, rtol=0)
    torch.testing.assert_close(pool, pool_long)
    torch.testing.assert_close(pool[2].t(), x[-(W - 1):])  # last W-1 inputs, oldest first


def test_conv_spec_decode_with_accepted_tokens():
    """Two verify steps of S = 3 tokens with the sliding-window state: outputs equal a
    plain conv over the accepted history."""
    num_spec = 2
    s_len = num_spec + 1
    x, weight = conv_inputs(5 + 2 * s_len, seed=43)
    pool = torch.zeros(2, C, W - 1 + num_spec)
    kda.causal_conv1d_prefill(x[:5], weight, None, pool, torch.tensor([0, 5]),
                              torch.tensor([1]), torch.tensor([False]))
    step1 = x[5:5 + s_len]
    out1 = kda.causal_conv1d_update(step1, weight, None, pool, torch.tensor([1]),
                                    cu_seqlens=torch.tensor([0, s_len]),
                                    num_accepted_tokens=torch.tensor([1]))
    ref1, _ = naive_conv(step1, weight, x[2:5])
    torch.testing.assert_close(out1.double(), ref1, atol=1e-5, rtol=0)
    accepted = 2  # the first 2 of step 1 are kept
    step2 = x[5 + s_len:]
    out2 = kda.causal_conv1d_update(step2, weight, None, pool, torch.tensor([1]),
                                    cu_seqlens=torch.tensor([0, s_len]),
                                    num_accepted_tokens=torch.tensor([accepted]))
    history = torch.cat([x[:5], step1[:accepted]])[-(W - 1):]
    ref2, _ = naive_conv(step2, weight, history)
    torch.testing.assert_close(out2.double(), ref2, atol=1e-5, rtol=0)


def test_conv_update_skips_null_slot():
    x, weight = conv_inputs(2, seed=44)
    pool = torch.randn(3, C, W - 1)
    before = pool.clone()
    out = kda.causal_conv1d_update(x, weight, None, pool, torch.tensor([0, 2]))
    assert bool((out[0] == 0).all())
    torch.testing.assert_close(pool[[0, 1]], before[[0, 1]])


def test_gated_rms_norm():
    gen = torch.Generator().manual_seed(50)
    x = torch.randn(4, H, DV, generator=gen)
    gate = torch.randn(4, H, DV, generator=gen)
    weight = torch.randn(DV, generator=gen)
    got = kda.gated_rms_norm(x, gate, weight, 1e-6, activation="sigmoid")
    for t in range(4):
        for h in range(H):
            row = x[t, h].double()
            rms = math.sqrt(float((row * row).mean()) + 1e-6)
            want = row / rms * weight.double() / (1 + torch.exp(-gate[t, h].double()))
            torch.testing.assert_close(got[t, h].double(), want, atol=1e-5, rtol=1e-5)
