"""Times the decode-step stand-ins (``benchmarks/decode_standins.py``) alone on the GPU, per
layer, at the model's sizes: each op over as many layers' weights/caches as the model has
(rotated beyond the 60 MB L2), captured back to back in one CUDA graph; MLA and router over a
small config sweep, MLA's passes also alone. Prints us per layer, the bytes the op must move, and the fraction of the
copy bandwidth measured in the same run; for the router also cuBLAS's fp32 GEMV alone.

``python -m benchmarks.standins_timing [--tokens 1 4 8 32] [--context 32768]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

from benchmarks import decode_standins as S
from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.timing import stacked_time_us
from vllm_ling.ops.moe.activation import SHARED_EXPERT_CLAMP

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "vllm_ling", "data",
                      "ling3_flash_fp4_config.json")


def timed(fns, replays=20):
    try:
        return stacked_time_us(fns, replays)
    except Exception as exc:  # noqa: BLE001 - a config that does not compile (shared memory) is skipped
        print(f"    skipped: {type(exc).__name__}: {str(exc)[:120]}")
        return float("inf")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32])
    ap.add_argument("--context", type=int, default=32768)
    args = ap.parse_args(argv)
    cfg = json.load(open(CONFIG))
    dev = torch.device("cuda")
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    copy_gbs, how = copy_bandwidth_gbs()
    print(f"{torch.cuda.get_device_name()}; copy bandwidth {copy_gbs:.0f} GB/s ({how}); torch {torch.__version__}")
    g = torch.Generator(device=dev).manual_seed(0)
    H, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
    lora, rope, nope, vd = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    E = cfg["num_experts"]
    n_mla, n_kda, n_moe = 8, 35, 41  # 7 MLA + NEXTN; KDA layers; 40 MoE + NEXTN
    bf = torch.bfloat16
    rows = []

    def row(op, T, cfg_s, us, nbytes):
        frac = nbytes / (us * 1e-6) / 1e9 / copy_gbs if nbytes else float("nan")
        rows.append((op, T, cfg_s, us, nbytes / 1e6, frac))
        print(f"  {op:16s} T={T:2d} {cfg_s:38s} {us:8.2f} us/layer  {nbytes / 1e6:8.2f} MB  {frac:5.2f}", flush=True)

    ctx = args.context
    Tmax = max(args.tokens)
    caches = [(torch.randn((ctx + Tmax + 1, lora + rope), device=dev, generator=g) * 0.1).to(bf) for _ in range(n_mla)]
    w_uk = [(torch.randn((heads, nope, lora), device=dev, generator=g) * nope**-0.5).to(bf) for _ in range(n_mla)]
    w_uv_t = [(torch.randn((heads, vd, lora), device=dev, generator=g) * lora**-0.5).to(bf) for _ in range(n_mla)]
    norm_w = torch.ones(lora, device=dev, dtype=bf)
    cos, sin = S.rope_table(cfg["rope_theta"], rope, ctx + Tmax + 2, dev)
    routers = [torch.randn((E, H), device=dev, generator=g) * H**-0.5 for _ in range(n_moe)]
    bias = torch.randn(E, device=dev, generator=g) * 0.01
    P = heads * hd
    conv_states = [torch.zeros((3 * P, 3), device=dev, dtype=bf) for _ in range(n_kda)]
    conv_w = [torch.randn((3 * P, 4), device=dev, generator=g) * 0.5 for _ in range(n_kda)]
    o_norm = torch.ones(hd, device=dev, dtype=bf)
    kw = dict(top_k=cfg["num_experts_per_tok"], n_group=cfg["n_group"], topk_group=cfg["topk_group"],
              routed_scaling_factor=cfg["routed_scaling_factor"])
    for T in args.tokens:
        x = torch.randn((T, H), device=dev, generator=g).to(bf)
        # ---- MLA: prepare, W_UK bmm, split pass (sweep), combine pass (sweep), all four ----
        q = (torch.randn((T, heads, nope + rope), device=dev, generator=g)).to(bf)
        kv = torch.randn((T, lora + rope), device=dev, generator=g).to(bf)
        gate = torch.randn((T, heads), device=dev, generator=g).to(bf)
        mla_bytes = (ctx + T) * (lora + rope) * 2 + (w_uk[0].numel() + w_uv_t[0].numel()) * 2
        scale = (nope + rope) ** -0.5
        R = T * heads
        us = timed([lambda i=i: S.mla_prepare(q, kv, norm_w, caches[i], ctx, cos, sin, nope=nope)
                    for i in range(n_mla)])
        row("mla_prepare", T, "", us, 0)
        q_lat = torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk[0])
        us = timed([lambda i=i: torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk[i]) for i in range(n_mla)])
        row("mla_wuk_bmm", T, "cuBLAS", us, w_uk[0].numel() * 2)
        sweep = []
        grid = ([(32, bn, nw, st, 1) for bn in (32, 64) for nw in (4, 8) for st in (2, 3)] + [(32, 64, 4, 3, 2)]
                if R <= 32 else [(bm, bn, nw, 2, 2) for bm in (32, 64) for bn in (32, 64) for nw in (4, 8)])
        for bm, bn, nw, st, pps in grid:
            split = dict(block_m=bm, block_n=bn, num_warps=nw, num_stages=st, programs_per_sm=pps)
            us = timed([lambda i=i, split=split: S.mla_split_pass(q, q_lat, caches[i], ctx, nope=nope, scale=scale,
                                                                  **split) for i in range(n_mla)])
            sweep.append((us, split))
        for us, split in sorted(sweep, key=lambda t: t[0])[:3]:
            row("mla_split_pass", T, " ".join(f"{k}={v}" for k, v in split.items()), us,
                (ctx + T) * (lora + rope) * 2)
        best_split = min(sweep, key=lambda t: t[0])[1]
        parts = [S.mla_split_pass(q, q_lat, caches[i], ctx, nope=nope, scale=scale, **best_split) for i in range(n_mla)]
        sweep = []
        for sb, vp, nw in [(16, 1, 4), (16, 2, 4), (16, 4, 4), (32, 1, 4), (32, 2, 4), (32, 4, 4), (32, 2, 8)]:
            comb = dict(s_block=sb, v_part=vp, num_warps=nw)
            us = timed([lambda i=i, comb=comb: S.mla_combine_pass(*parts[i], w_uv_t[i], gate, **comb)
                        for i in range(n_mla)])
            sweep.append((us, comb))
        for us, comb in sorted(sweep, key=lambda t: t[0])[:3]:
            row("mla_combine_pass", T,
                f"splits={parts[0][0].shape[1]} " + " ".join(f"{k}={v}" for k, v in comb.items()), us, parts[0][0].numel() * 4 + w_uv_t[0].numel() * 2)
        best_comb = min(sweep, key=lambda t: t[0])[1]

        def layer(i, split, comb):
            def f():
                S.mla_prepare(q, kv, norm_w, caches[i], ctx, cos, sin, nope=nope)
                ql = torch.bmm(q[:, :, :nope].transpose(0, 1), w_uk[i])
                return S.mla_decode(q, ql, caches[i], ctx, w_uv_t[i], gate, nope=nope, scale=scale, combine=comb,
                                    **split)
            return f
        row("mla_attention", T, "all four launches, best configs",
            timed([layer(i, best_split, best_comb) for i in range(n_mla)]), mla_bytes)
        row("mla_attention", T, "all four launches, defaults", timed([layer(i, {}, None) for i in range(n_mla)]),
            mla_bytes)
        # ---- KDA conv + gated norm ----
        qkv = torch.randn((T, 3 * P), device=dev, generator=g).to(bf)
        o = torch.randn((1, T, heads, hd), device=dev, generator=g).to(bf)
        gt = torch.randn((T, P), device=dev, generator=g).to(bf)
        us = timed([lambda i=i: S.conv4_silu_update(qkv, conv_states[i], conv_w[i], split=P) for i in range(n_kda)])
        row("kda_conv", T, "", us, 2 * conv_states[0].numel() * 2 + conv_w[0].numel() * 4 + 2 * qkv.numel() * 2)
        us = timed([lambda: S.gated_rms_norm(o, gt, o_norm) for _ in range(n_kda)])
        row("kda_gated_norm", T, "", us, 3 * o.numel() * 2)
        # ---- router: grouped top-k of the gate's logits (the GEMV: benchmarks/small_gemv.py) ----
        xf = x.float()
        logits = [F.linear(xf, routers[i]) for i in range(n_moe)]
        for nw in (1, 2, 4):
            us = timed([lambda i=i, nw=nw: S.grouped_topk(logits[i], bias, num_warps=nw, **kw) for i in range(n_moe)])
            row("router_topk", T, f"w{nw}", us, E * 4)
        us = timed([lambda i=i: F.linear(xf, routers[i]) for i in range(n_moe)])
        row("router_gemv_cublas", T, "(fp32 GEMV alone, reference)", us, E * H * 4)
        # ---- SwiGLU, add + RMSNorm ----
        h = torch.randn((T, 2 * cfg["moe_shared_expert_intermediate_size"]), device=dev, generator=g).to(bf)
        us = timed([lambda: S.swiglu_act(h, 7.0, SHARED_EXPERT_CLAMP) for _ in range(n_moe)])
        row("swiglu", T, "shared expert, limit", us, 0)
        r1, r2, resid = (torch.randn((T, H), device=dev, generator=g).to(bf) for _ in range(3))
        nw_ = torch.ones(H, device=dev, dtype=bf)
        us = timed([lambda: S.fused_add_rms_norm(r1, resid, nw_, x2=r2) for _ in range(n_moe)])
        row("add3_rms_norm", T, "", us, 0)
    print("\n| op | T | config | us/layer | MB | fraction of copy BW |\n|---|---|---|---|---|---|")
    for op, T, c, us, mb, frac in rows:
        print(f"| {op} | {T} | {c} | {us:.2f} | {mb:.2f} | {frac:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
