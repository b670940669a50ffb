"""The decode-step benchmark's Triton stand-ins (``benchmarks/decode_standins.py``) against
plain-PyTorch references written here from what the vLLM kernels compute.

On a CPU machine the kernels run in Triton's interpreter (``TRITON_INTERPRET=1``, set before
Triton is imported, so in a subprocess that runs this file as a script) at small shapes that
still cross every mask, split and chunk boundary; on the GPU (``gpu`` marker) the compiled
kernels run at the model's sizes. Tolerances: BF16 outputs within a relative (norm) error of
1e-2 of an fp32 reference (two or three BF16 roundings, 2**-9 each); fp32 router logits within
1e-5; routing ids exact against the reference top-k of the kernel's own logits and, against the
reference router, except where two candidates tie within 1e-5 (GEMV summation order).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]

BF16_REL = 1e-2


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


# ---- plain-PyTorch references (fp32) ----

def ref_rms(x, w, eps=1e-6):
    x = x.float()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w.float()


def ref_conv4_silu(x, state, weight):
    """Per token: window = [3 older inputs, new input]; y = silu(sum(window * taps))."""
    window = [state[:, j].float() for j in range(3)]
    outs = []
    for t in range(x.shape[0]):
        window.append(x[t].float())
        y = sum(window[j] * weight[:, j].float() for j in range(4))
        outs.append(torch.nn.functional.silu(y))
        window.pop(0)
    return torch.stack(outs), torch.stack(window, 1)


def ref_rope_interleaved(x, cos, sin):
    """GPT-J style: pairs (x[2i], x[2i+1]) rotated by angle i; cos/sin broadcast over x[..., :half]."""
    xe, xo = x[..., 0::2].float(), x[..., 1::2].float()
    return torch.stack([xe * cos - xo * sin, xo * cos + xe * sin], -1).flatten(-2)


def ref_mla(q, kv, norm_w, cache, pos, cos, sin, w_uk, w_uv, gate_logits, nope, scale):
    """Returns (out [T, heads * vd], new cache rows [T, lora + rope])."""
    T, heads, _ = q.shape
    lora = norm_w.numel()
    c = ref_rms(kv[:, :lora], norm_w)
    kpe = ref_rope_interleaved(kv[:, lora:], cos[pos:pos + T], sin[pos:pos + T])
    new_rows = torch.cat([c, kpe], -1)
    full = torch.cat([cache[:pos].float(), new_rows.to(cache.dtype).float()], 0)
    qpe = ref_rope_interleaved(q[:, :, nope:], cos[pos:pos + T, None], sin[pos:pos + T, None])
    q_lat = torch.einsum("thn,hnl->thl", q[:, :, :nope].float(), w_uk.float())
    outs = []
    for t in range(T):
        keys = full[:pos + t + 1]
        s = (q_lat[t] @ keys[:, :lora].t() + qpe[t] @ keys[:, lora:].t()) * scale  # [heads, n]
        lat = torch.softmax(s, -1) @ keys[:, :lora]
        o = torch.einsum("hl,hlv->hv", lat, w_uv.float())
        if gate_logits is not None:
            o = o * torch.sigmoid(gate_logits[t].float())[:, None]
        outs.append(o.reshape(-1))
    return torch.stack(outs), new_rows


# ---- the checks: each returns {name: (value, bound)} ----

def measure(device: str, full: bool = False) -> dict[str, list[float]]:
    from benchmarks import decode_standins as S
    from vllm_ling.ops.moe.activation import SwigluClamp, swiglu
    from vllm_ling.ops.moe.routing import grouped_topk, route

    dev = torch.device(device)
    g = torch.Generator(device="cpu").manual_seed(0)

    def rnd(*shape, scale=1.0, dtype=torch.bfloat16):
        return (torch.randn(shape, generator=g) * scale).to(dtype).to(dev)

    res: dict[str, list[float]] = {}
    bf = torch.bfloat16

    # router: grouped top-k of fp32 logits
    E, H, G, TG, K = (512, 2560, 8, 4, 8) if full else (64, 96, 8, 4, 8)
    gate_w = rnd(E, H, scale=H**-0.5, dtype=torch.float32)
    bias = rnd(E, scale=0.01, dtype=torch.float32)
    kw = dict(top_k=K, n_group=G, topk_group=TG, routed_scaling_factor=2.5)
    for T, warps in ((1, 1), (5, 1), (5, 4), (32, 2)):
        x = rnd(T, H)
        logits = x.float() @ gate_w.t()
        w, ids = S.grouped_topk(logits, bias, num_warps=warps, **kw)
        tag = f"{T}_{warps}"
        w_ref, ids_ref = grouped_topk(logits, K, G, TG, bias, True, 2.5)
        res[f"router_ids_T{tag}"] = [float((ids != ids_ref).sum()), 0.0]
        res[f"router_weights_T{tag}"] = [rel(w, w_ref), 1e-6]
        w_r, ids_r = route(x, gate_w, bias, **kw)
        choice = torch.sigmoid(logits) + bias
        # a different pick is allowed only where the two choices' biased scores tie within 1e-5
        res[f"router_vs_route_T{tag}"] = [float(((choice.gather(1, ids.long()) -
                                                 choice.gather(1, ids_r.long())).abs() > 1e-5).sum()), 0.0]

    # residual add (+ second addend) + RMSNorm
    Hn = 2560 if full else 200
    for with_x2 in (False, True):
        x, x2, resid, w = rnd(3, Hn), rnd(3, Hn), rnd(3, Hn), rnd(Hn, scale=0.1) + 1
        want_res = resid.float() + x.float() + (x2.float() if with_x2 else 0)
        out = S.fused_add_rms_norm(x, resid, w, 1e-6, x2=x2 if with_x2 else None)
        res[f"add_rms_norm_x2={with_x2}_residual"] = [rel(resid, want_res), BF16_REL]
        res[f"add_rms_norm_x2={with_x2}_out"] = [rel(out, ref_rms(want_res, w)), BF16_REL]

    # SwiGLU, both clamp modes and no limit
    d = 768 if full else 50
    x = rnd(3, 2 * d, scale=4.0)
    for limit, clamp in ((None, SwigluClamp.GATE_OUTPUT), (2.0, SwigluClamp.GATE_INPUT), (2.0, SwigluClamp.GATE_OUTPUT)):
        res[f"swiglu_{limit}_{clamp}"] = [rel(S.swiglu_act(x, limit, clamp), swiglu(x.float(), limit, clamp)),
                                          BF16_REL]

    # KDA short conv + SiLU + state update, q/k/v written apart
    P = 4096 if full else 40
    for T in (1, 4):
        x = rnd(T, 3 * P)
        state = rnd(3 * P, 3)
        weight = rnd(3 * P, 4, scale=0.5, dtype=torch.float32)
        y_ref, state_ref = ref_conv4_silu(x, state, weight)
        y = S.conv4_silu_update(x, state, weight, split=P)
        res[f"conv_out_T{T}"] = [rel(y.permute(1, 0, 2).reshape(T, 3 * P), y_ref), BF16_REL]
        res[f"conv_state_T{T}"] = [rel(state, state_ref), 0.0]  # the state holds the inputs exactly

    # gated RMSNorm
    heads, D = (32, 128) if full else (5, 32)
    o, gate, w = rnd(1, 3, heads, D), rnd(3, heads * D), rnd(D, scale=0.1) + 1
    want = (ref_rms(o.view(3, heads, D), w) * torch.sigmoid(gate.float().view(3, heads, D))).view(3, heads * D)
    res["gated_rms_norm"] = [rel(S.gated_rms_norm(o, gate, w), want), BF16_REL]
    # the gate as a column slice of a merged q|k|v|f|g projection output (row stride 5x its width)
    merged = rnd(3, 5 * heads * D)
    merged[:, 4 * heads * D:] = gate
    res["gated_rms_norm_row_strided_gate"] = [rel(S.gated_rms_norm(o, merged[:, 4 * heads * D:], w), want),
                                              BF16_REL]

    # MLA: prepare (norm, RoPE, cache write) + split-K decode + combine with W_UV and the gate
    if full:
        heads, lora, rope, nope, vd, pos = 32, 512, 64, 128, 128, 4000
        cases = [(1, None, None), (4, None, None), (32, None, None), (4, 64, 64)]
    else:
        heads, lora, rope, nope, vd, pos = 4, 64, 16, 32, 32, 50
        cases = [(1, 3, 16), (3, 4, 16), (3, 1, 16)]  # splits, block_n (uneven last split; a single split)
    cos, sin = S.rope_table(6e6, rope, pos + 40, dev)
    w_uk = rnd(heads, nope, lora, scale=nope**-0.5)
    w_uv = rnd(heads, lora, vd, scale=lora**-0.5)
    norm_w = rnd(lora, scale=0.1) + 1
    for T, splits, block_n in cases:
        cache = rnd(pos + T + 2, lora + rope)
        q = rnd(T, heads, nope + rope)
        kv = rnd(T, lora + rope)
        gate_logits = rnd(T, heads)
        scale = (nope + rope) ** -0.5
        want, new_rows = ref_mla(q, kv, norm_w, cache, pos, cos, sin, w_uk, w_uv, gate_logits, nope, scale)
        before = cache.clone()
        S.mla_prepare(q, kv, norm_w, cache, pos, cos, sin, nope=nope)
        q_lat = torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk)
        split = {} if splits is None else dict(splits=splits, block_n=block_n)
        out = S.mla_decode(q, q_lat, cache, pos, w_uv.transpose(1, 2).contiguous(), gate_logits, nope=nope,
                           scale=scale, combine=dict(s_block=2, v_part=2) if not full else None, **split)
        tag = f"T{T}_splits{splits}"
        res[f"mla_cache_rows_{tag}"] = [rel(cache[pos:pos + T], new_rows), BF16_REL]
        res[f"mla_cache_untouched_{tag}"] = [float((cache[:pos] != before[:pos]).sum()
                                                   + (cache[pos + T:] != before[pos + T:]).sum()), 0.0]
        res[f"mla_out_{tag}"] = [rel(out, want), 2 * BF16_REL]  # q_pe, q_lat, P and the latent each rounded
    return res


def _check(res: dict[str, list[float]]) -> None:
    bad = {k: v for k, v in res.items() if not v[0] <= v[1]}
    assert not bad, f"outside tolerance (value, bound): {bad}"


def test_standins_in_triton_interpreter():
    pytest.importorskip("triton")
    if torch.cuda.is_available():
        pytest.skip("interpreter check is for CPU machines; test_standins_gpu covers the compiled kernels")
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(REPO))
    proc = subprocess.run([sys.executable, __file__], capture_output=True, text=True, env=env, timeout=600,
                          cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(res) >= 25
    _check(res)


@pytest.mark.gpu
def test_standins_gpu():
    _check(measure("cuda", full=True))


if __name__ == "__main__":  # the interpreter run (see test_standins_in_triton_interpreter); "cuda": full size
    full = sys.argv[1:] == ["cuda"]
    print(json.dumps(measure("cuda" if full else "cpu", full=full)))
