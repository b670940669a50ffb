"""One full Ling-3.0-flash-fp4 decode step on one GPU, at full size, in one CUDA graph.

Random weights in the checkpoint's formats (FP8 e4m3 dense linears with 128x128 block scales,
MXFP4 routed experts with E8M0 scales, fp32 routers + expert bias, BF16 norms, BF16 head
quantized online to FP8 per channel as the plugin does), every layer in the real order and
pattern (35 KDA + 7 MLA attention, 2 dense MLP + 40 MoE), then one NEXTN draft step (eh_proj,
MLA, MoE, head). A step of T tokens is one sequence's verify window of T positions over a
32K-token context (what ``vllm-ling plan`` counts). Two compositions, same weights, same run:

- ``vllm-ling``: dense FP8 linears through ``vllm_ling.ops.dense_fp8`` (W8A16; each KDA layer's
  q, k, v, f, g as one 20480 x 2560 launch, as ``vllm_ling.layers.kda_merged_in_proj`` serves them), routed experts
  through the MoE decode kernels on humming's weights (``HummingMxfp4Experts`` default), the
  FP8 head (``vllm_ling.ops.lm_head``, kernel chosen per arch), the router GEMV
  (``vllm_ling.ops.small_gemv.router``);
- ``upstream``: what vLLM 0.32 runs on sm_90: humming's indexed GEMM for the experts, the BF16
  head, the W8A8 block-FP8 stand-in for DeepGEMM (``benchmarks/upstream_fp8.py``),
  GateLinear's fp32 path for the router (cast + cuBLAS), and KDA's qkv_proj, f_proj and g_proj as
  three launches on row slices of the same merged weight.

Both compositions run each MoE layer's shared expert on a second stream, overlapping the top-k and
the routed experts, as vLLM 0.32's MoE runner does for up to 256 tokens on CUDA.

Ops that live in vLLM and have no kernel in this repo are stand-ins, named in the output and
the same in both compositions: the KDA recurrence is flash-linear-attention 0.6.0's
``fused_recurrent_kda`` (gate, beta and q/k L2 norm fused, what vLLM vendors); the KDA short
conv and gated output norm, MLA decode attention (split-K over the 32K BF16 latent cache), the
router's grouped top-k, SwiGLU and residual add + RMSNorm are Triton kernels in
``benchmarks/decode_standins.py`` that compute what vLLM's kernels compute in at most as many
launches. Reports us per step, per op class time (a graph of that class's ops alone),
bytes, fraction of the copy bandwidth measured in the same run, the byte-model floor from
``plan`` at that bandwidth, kernel launches per step, and the vllm-ling / upstream ratio.
"""

from __future__ import annotations

import argparse
import collections
import datetime
import json
import os
import sys
import time
import traceback

import torch
import torch.nn.functional as F

from benchmarks.decode_standins import (conv4_silu_update, fused_add_rms_norm, gated_rms_norm, grouped_topk,
                                        mla_decode, mla_prepare, rope_table, swiglu_act)
from benchmarks.dense_fp8 import load_config
from benchmarks.lm_head import copy_bandwidth_gbs
from benchmarks.output import write_outputs
from benchmarks.timing import stacked_time_us
from benchmarks.upstream_fp8 import ScaledMmBlockFp8
from vllm_ling.ops.dense_fp8 import w8a16_linear
from vllm_ling.ops.dense_fp8.tuned_configs import w8a16_max_rows
from vllm_ling.ops.fp8 import block_fp8_quantize
from vllm_ling.ops.moe.activation import SHARED_EXPERT_CLAMP
from vllm_ling.ops.moe.humming import HummingMxfp4Experts
from vllm_ling.ops.moe.routing import route
from vllm_ling.ops.moe.warmup import random_mxfp4_experts
from vllm_ling.ops.small_gemv.router import MAX_ROWS as ROUTER_MAX_ROWS
from vllm_ling.ops.small_gemv.router import router_logits
from vllm_ling.ops.small_gemv import BF16_MAX_ROWS
from vllm_ling.ops.small_gemv import small_gemv

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(REPO, "vllm_ling", "data", "ling3_flash_fp4_config.json")
STANDINS = {
    "kda_recurrent": "fla-core 0.6.0 fused_recurrent_kda (gate, beta sigmoid, q/k L2 norm in kernel)",
    "kda_conv_norm": "Triton (benchmarks/decode_standins.py): one launch for the q/k/v causal short conv (window "
                     "4) + SiLU + conv-state update over the T tokens (vLLM: causal_conv1d_update, once each for "
                     "q, k, v), one for the gated RMSNorm (vLLM: FusedRMSNormGated, sigmoid gate)",
    "mla_attention": "Triton split-K MLA decode over the 32K BF16 latent cache (benchmarks/decode_standins.py; "
                     "vLLM: triton_decode_attention's MLA kernels, FlashMLA on sm_90): one launch for kv_a RMSNorm "
                     "+ RoPE of q_pe/k_pe + latent-cache write (vLLM: RMSNorm, rotary, concat_and_cache_mla), the "
                     "W_UK bmm (cuBLAS), one split-K pass reading each cache row once per block of query rows "
                     "(online softmax, causal over the verify window), one combine pass that merges the splits "
                     "and applies W_UV and the sigmoid head gate",
    "router": "the gate GEMV is each composition's own (vllm-ling: vllm_ling.ops.small_gemv.router up to 16 tokens; "
              "upstream: vLLM GateLinear's path for this gate, cast to fp32 + cuBLAS fp32 F.linear); the grouped "
              "top-k after it is a stand-in, Triton with a program per token (benchmarks/decode_standins.py; "
              "vLLM: the fused grouped_topk kernel); ids checked against vllm_ling.ops.moe.routing.route",
    "norms_residual": "Triton (benchmarks/decode_standins.py): residual add + RMSNorm in one launch, the MoE "
                      "layer's routed + shared sum folded in (vLLM: fused_add_rms_norm), SwiGLU with the "
                      "per-layer limit in one launch (vLLM: SiluAndMul / SwigluStepAndMul); embedding gather "
                      "and the NEXTN input norms as PyTorch ops",
    "small_bf16": "KDA b_proj, MLA g_proj (left in BF16 by the checkpoint): vllm-ling's small GEMV up to 8 "
                  "tokens (vllm_ling.ops.small_gemv), BF16 cuBLAS above and upstream (the g_proj sigmoid "
                  "runs in the MLA combine pass, b's in the KDA recurrence)",
}


DENSE_CONFIGS: dict[tuple[int, int, int], object] = {}  # --dense-configs: (N, K, rows) -> config


class Fp8Linear:
    """One dense block-FP8 weight with both compositions' kernels."""

    def __init__(self, n: int, k: int, gen: torch.Generator, dev):
        self.q, self.s = block_fp8_quantize(torch.randn((n, k), device=dev, generator=gen) * (1.0 / k**0.5))
        self.up = ScaledMmBlockFp8(self.q, self.s)
        self.bytes = self.q.numel() + 4 * self.s.numel()

    @classmethod
    def rows(cls, whole: "Fp8Linear", start: int, stop: int) -> "Fp8Linear":
        """Rows [start, stop) of ``whole`` (128-row aligned: the block scales slice the same way),
        sharing its storage: the upstream composition's unmerged parts of a merged weight."""
        if start % 128 or stop % 128:
            raise ValueError(f"rows {start}:{stop} are not on the 128-row block grid")
        part = cls.__new__(cls)
        part.q, part.s = whole.q[start:stop], whole.s[start // 128: stop // 128]
        part.up = ScaledMmBlockFp8(part.q, part.s)
        part.bytes = part.q.numel() + 4 * part.s.numel()
        return part

    def __call__(self, x: torch.Tensor, comp: str) -> torch.Tensor:
        # the serving method hands larger batches of the widest weights to vLLM's W8A8 kernel
        if comp != "ours" or x.shape[0] > w8a16_max_rows(*self.q.shape, torch.cuda.get_device_capability(x.device)):
            return self.up(x)
        return w8a16_linear(x, self.q, self.s, config=DENSE_CONFIGS.get((*self.q.shape, x.shape[0])))


def bf16_linear(x: torch.Tensor, weight: torch.Tensor, comp: str) -> torch.Tensor:
    """A BF16 linear the checkpoint leaves unquantized, as each composition runs it."""
    if comp == "ours" and x.shape[0] <= BF16_MAX_ROWS:
        return small_gemv(x, weight, torch.bfloat16)
    return F.linear(x, weight)


def torch_kda_recurrent(q, k, v, g, beta, A_log, dt_bias, initial_state, lower_bound, **_):
    """Plain-PyTorch KDA decode recurrence (fallback stand-in): per token, per head
    S = diag(a) S + beta k (v - S^T k)^T... in fp32; returns (o [1, T, H, D], state)."""
    S = initial_state[0]
    outs = []
    for t in range(q.shape[1]):
        qt = F.normalize(q[0, t].float(), dim=-1)
        kt = F.normalize(k[0, t].float(), dim=-1)
        a = torch.exp(lower_bound * torch.sigmoid(torch.exp(A_log)[:, None] * (g[0, t].float() + dt_bias.view_as(g[0, t]))))
        bt = torch.sigmoid(beta[0, t].float())[:, None]
        S = S * a[:, :, None]
        S = S + kt[:, :, None] * (bt * (v[0, t].float() - torch.einsum("hkv,hk->hv", S, kt)))[:, None, :]
        outs.append(torch.einsum("hkv,hk->hv", S, qt * qt.shape[-1] ** -0.5))
    initial_state[0].copy_(S)
    return torch.stack(outs)[None].to(q.dtype), initial_state


def rms(x, w, eps=1e-6):
    return F.rms_norm(x, (x.shape[-1],), w, eps)


class Model:
    def __init__(self, cfg: dict, tokens_max: int, context: int, dev, seed: int = 0):
        try:
            from fla.ops.kda import fused_recurrent_kda
        except Exception as exc:  # noqa: BLE001 - reported; the torch recurrence stands in
            STANDINS["kda_recurrent"] = f"PyTorch per-token recurrence (fla unavailable: {type(exc).__name__}: {exc})"
            fused_recurrent_kda = torch_kda_recurrent
        self.kda_fn = fused_recurrent_kda
        self.aux = torch.cuda.Stream(device=dev)  # vLLM's shared-expert stream
        self.shared_stream = True  # False: as vLLM runs it with VLLM_DISABLE_SHARED_EXPERTS_STREAM=1
        g = torch.Generator(device=dev).manual_seed(seed)
        self.cfg, self.dev = cfg, dev
        H, heads, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]
        self.H, self.heads, self.hd = H, heads, hd
        proj = heads * hd
        n_layers = cfg["num_hidden_layers"]
        self.kv_lora, self.rope = cfg["kv_lora_rank"], cfg["qk_rope_head_dim"]
        self.nope, self.vd = cfg["qk_nope_head_dim"], cfg["v_head_dim"]
        self.context = context
        self.layers = []
        t0 = time.perf_counter()
        for i in range(n_layers + 1):
            mtp = i == n_layers
            kda = not mtp and ((i + 1) % cfg["layer_group_size"] != 0 and i < n_layers // cfg["layer_group_size"]
                               * cfg["layer_group_size"])
            L = {"kda": kda, "mtp": mtp, "idx": i,
                 "in_norm": torch.ones(H, device=dev, dtype=torch.bfloat16),
                 "post_norm": torch.ones(H, device=dev, dtype=torch.bfloat16)}
            if kda:
                # q|k|v|f|g: one weight; upstream's three linears are row slices of it (a tuple,
                # so class_bytes counts the bytes once)
                L["qkvfg"] = Fp8Linear(5 * proj, H, g, dev)
                L["upstream_in_proj"] = tuple(Fp8Linear.rows(L["qkvfg"], a * proj, b * proj)
                                              for a, b in ((0, 3), (3, 4), (4, 5)))
                L["o"] = Fp8Linear(H, proj, g, dev)
                L["b"] = (torch.randn((heads, H), device=dev, generator=g) * H**-0.5).to(torch.bfloat16)
                L["conv_w"] = torch.randn((3 * proj, 4), device=dev, generator=g) * 0.5
                L["conv_state"] = torch.zeros((3 * proj, 3), device=dev, dtype=torch.bfloat16)
                L["dt_bias"] = torch.zeros(proj, device=dev)
                L["A_log"] = torch.zeros(heads, device=dev)
                L["o_norm"] = torch.ones(hd, device=dev, dtype=torch.bfloat16)
                L["state"] = torch.zeros((1, heads, hd, hd), device=dev)
            else:
                L["q"] = Fp8Linear(heads * (self.nope + self.rope), H, g, dev)
                L["kv_a"] = Fp8Linear(self.kv_lora + self.rope, H, g, dev)
                L["kv_norm"] = torch.ones(self.kv_lora, device=dev, dtype=torch.bfloat16)
                L["w_uk"] = (torch.randn((heads, self.nope, self.kv_lora), device=dev, generator=g)
                             * self.nope**-0.5).to(torch.bfloat16)
                # W_UV stored transposed [heads, vd, kv_lora] (a layout choice made once at load)
                L["w_uv_t"] = (torch.randn((heads, self.vd, self.kv_lora), device=dev, generator=g)
                               * self.kv_lora**-0.5).to(torch.bfloat16)
                L["g"] = (torch.randn((heads, H), device=dev, generator=g) * H**-0.5).to(torch.bfloat16)
                L["dense"] = Fp8Linear(H, heads * self.vd, g, dev)
                L["cache"] = (torch.randn((context + tokens_max + 1, self.kv_lora + self.rope), device=dev,
                                          generator=g) * 0.1).to(torch.bfloat16)
            if mtp:
                L["eh"] = Fp8Linear(H, 2 * H, g, dev)
                for name in ("enorm", "hnorm", "final_norm"):
                    L[name] = torch.ones(H, device=dev, dtype=torch.bfloat16)
            if not mtp and i < cfg["first_k_dense_replace"]:
                L["gate_up"] = Fp8Linear(2 * cfg["intermediate_size"], H, g, dev)
                L["down"] = Fp8Linear(H, cfg["intermediate_size"], g, dev)
            else:
                E, inter, si = cfg["num_experts"], cfg["moe_intermediate_size"], cfg["moe_shared_expert_intermediate_size"]
                L["router"] = torch.randn((E, H), device=dev, generator=g) * H**-0.5
                L["bias"] = torch.randn(E, device=dev, generator=g) * 0.01
                L["experts"] = HummingMxfp4Experts(**random_mxfp4_experts(E, H, inter, device=dev, seed=1000 + i),
                                                   top_k=cfg["num_experts_per_tok"])
                lim = (cfg.get("expert_swiglu_limit_list") or [0] * 64)
                slim = (cfg.get("share_expert_swiglu_limit_list") or [0] * 64)
                L["limit"] = (lim[i] or None) if i < len(lim) else None
                L["shared_limit"] = (slim[i] or None) if i < len(slim) else None
                L["sh_gate_up"] = Fp8Linear(2 * si, H, g, dev)
                L["sh_down"] = Fp8Linear(H, si, g, dev)
                L["ids"] = None
            self.layers.append(L)
            if i % 10 == 0:
                print(f"  built layer {i} ({time.perf_counter() - t0:.1f} s, "
                      f"{torch.cuda.memory_allocated() / 1e9:.1f} GB)", flush=True)
        V = cfg["vocab_size"]
        self.final_norm = torch.ones(H, device=dev, dtype=torch.bfloat16)
        self.embed = (torch.randn((V, H), device=dev, generator=g) * 0.02).to(torch.bfloat16)
        self.head_bf16 = (torch.randn((V, H), device=dev, generator=g) * H**-0.5).to(torch.bfloat16)
        from vllm_ling.ops import lm_head as LH

        hq, hs = LH.quantize_fp8_per_channel(self.head_bf16)
        head = LH.select_head_kernel(dev)
        self.head_kernel, self.head_reason = head.choice, head.reason
        self.head_fp8 = LH.prepare_fp8_head(hq, hs, self.head_kernel)
        self.LH = LH
        self.rope_cos, self.rope_sin = rope_table(cfg["rope_theta"], self.rope, context + tokens_max + 2, dev)
        self.build_s = time.perf_counter() - t0

    # ---- ops; each returns its output; op() tags the op class ----
    @staticmethod
    def add_norm(x, resid, weight):
        """``resid += x`` and RMSNorm; x is one tensor or an MoE layer's (routed, shared) pair."""
        if isinstance(x, tuple):
            return fused_add_rms_norm(x[0], resid, weight, x2=x[1])
        return fused_add_rms_norm(x, resid, weight)

    def head(self, x, comp):
        return self.LH.fp8_head_logits(x, self.head_fp8) if comp == "ours" else F.linear(x, self.head_bf16)

    def kda(self, L, x, comp, op):
        T = x.shape[0]
        heads, hd = self.heads, self.hd
        if comp == "ours":  # one launch; the parts are column slices, read in place by the conv and
            # the gated norm; f is copied when T > 1 as the server does (vLLM's KDA gate kernel reads packed rows)
            qkvfg = op("dense_fp8", lambda: L["qkvfg"](x, comp))
            proj = heads * hd
            qkv, f, gate = qkvfg[:, :3 * proj], qkvfg[:, 3 * proj:4 * proj], qkvfg[:, 4 * proj:]
            f = op("dense_fp8", lambda: f.contiguous())
        else:
            qkv_l, f_l, g_l = L["upstream_in_proj"]
            qkv = op("dense_fp8", lambda: qkv_l(x, comp))
            f = op("dense_fp8", lambda: f_l(x, comp))
            gate = op("dense_fp8", lambda: g_l(x, comp))
        b = op("small_bf16", lambda: bf16_linear(x, L["b"], comp))

        qkv_c = op("kda_conv_norm", lambda: conv4_silu_update(qkv, L["conv_state"], L["conv_w"], split=heads * hd))

        def recurrent():
            q, k, v = (qkv_c[j].view(1, T, heads, hd) for j in range(3))
            o, _ = self.kda_fn(q, k, v, f.view(1, T, heads, hd), b.view(1, T, heads), A_log=L["A_log"],
                               dt_bias=L["dt_bias"], initial_state=L["state"], output_final_state=True,
                               use_qk_l2norm_in_kernel=True, use_gate_in_kernel=True,
                               use_beta_sigmoid_in_kernel=True, lower_bound=-5.0)
            return o
        o = op("kda_recurrent", recurrent)
        on = op("kda_conv_norm", lambda: gated_rms_norm(o.contiguous(), gate, L["o_norm"]))
        return op("dense_fp8", lambda: L["o"](on, comp))

    def mla(self, L, x, comp, op, pos):
        T = x.shape[0]
        heads = self.heads
        q = op("dense_fp8", lambda: L["q"](x, comp)).view(T, heads, self.nope + self.rope)
        kv = op("dense_fp8", lambda: L["kv_a"](x, comp))
        gate = op("small_bf16", lambda: bf16_linear(x, L["g"], comp))  # logits; the sigmoid is in the combine pass

        def attention():
            # RoPE of q's rope part happens in place, as vLLM's rotary does
            mla_prepare(q, kv, L["kv_norm"], L["cache"], pos, self.rope_cos, self.rope_sin, nope=self.nope)
            q_lat = torch.bmm(q[:, :, :self.nope].transpose(0, 1), L["w_uk"])  # [h, T, kv_lora]
            return mla_decode(q, q_lat, L["cache"], pos, L["w_uv_t"], gate, nope=self.nope,
                              scale=(self.nope + self.rope) ** -0.5)
        a = op("mla_attention", attention)
        return op("dense_fp8", lambda: L["dense"](a, comp))

    def mlp(self, L, x, comp, op):
        if "gate_up" in L:
            h = op("dense_fp8", lambda: L["gate_up"](x, comp))
            act = op("norms_residual", lambda: swiglu_act(h))
            return op("dense_fp8", lambda: L["down"](act, comp))

        # the gate GEMV as each composition runs it (vLLM: the model's GateLinear, before FusedMoE)
        logits = op("router", lambda: (router_logits(x, L["router"]) if comp == "ours" and x.shape[0] <= ROUTER_MAX_ROWS
                                       else F.linear(x.to(torch.float32), L["router"])))
        # vLLM 0.32's MoE runner launches the shared expert on an auxiliary stream for <= 256 tokens
        # on CUDA (SharedExpertsOrder.MULTI_STREAM_OVERLAPPED), overlapping top-k and the routed experts
        main = torch.cuda.current_stream()
        if not self.shared_stream:  # VLLM_DISABLE_SHARED_EXPERTS_STREAM=1: shared expert first, same stream
            sh = op("dense_fp8", lambda: L["sh_gate_up"](x, comp))
            sh_act = op("norms_residual", lambda: swiglu_act(sh, L["shared_limit"], SHARED_EXPERT_CLAMP))
            sh_out = op("dense_fp8", lambda: L["sh_down"](sh_act, comp))
            w, ids = op("router", lambda: self.topk(L, logits))
            return op("moe_routed", lambda: L["experts"](x, w, ids, L["limit"])), sh_out
        forked = torch.cuda.Event()
        forked.record(main)
        with torch.cuda.stream(self.aux):
            self.aux.wait_event(forked)
            sh = op("dense_fp8", lambda: L["sh_gate_up"](x, comp))
            sh_act = op("norms_residual", lambda: swiglu_act(sh, L["shared_limit"], SHARED_EXPERT_CLAMP))
            sh_out = op("dense_fp8", lambda: L["sh_down"](sh_act, comp))
            x.record_stream(self.aux)  # the caching allocator must not reuse x before the aux stream read it
            sh_out.record_stream(main)
            joined = torch.cuda.Event()
            joined.record(self.aux)

        w, ids = op("router", lambda: self.topk(L, logits))
        routed = op("moe_routed", lambda: L["experts"](x, w, ids, L["limit"]))
        main.wait_event(joined)
        return routed, sh_out  # summed by the next add + RMSNorm launch

    def topk(self, L, logits):
        w, ids = grouped_topk(logits, L["bias"], top_k=self.cfg["num_experts_per_tok"],
                              n_group=self.cfg["n_group"], topk_group=self.cfg["topk_group"],
                              routed_scaling_factor=self.cfg["routed_scaling_factor"])
        L["ids"] = ids
        return w, ids

    def step(self, tokens: torch.Tensor, comp: str, op, draft: bool = True):
        T = tokens.shape[0]
        pos = self.context
        resid = op("norms_residual", lambda: self.embed[tokens])
        target = self.layers[:-1]
        x = op("norms_residual", lambda: rms(resid, target[0]["in_norm"]))
        for li, L in enumerate(target):
            a = self.kda(L, x, comp, op) if L["kda"] else self.mla(L, x, comp, op, pos)
            x = op("norms_residual", lambda: self.add_norm(a, resid, L["post_norm"]))
            m = self.mlp(L, x, comp, op)
            nxt_w = target[li + 1]["in_norm"] if li + 1 < len(target) else self.final_norm
            x = op("norms_residual", lambda: self.add_norm(m, resid, nxt_w))
        hidden = x
        logits = op("head", lambda: self.head(hidden, comp))
        if not draft:
            return logits
        # NEXTN draft step for the last position (one token, as the plan counts it):
        # embed(next token) + hidden -> eh_proj -> MLA -> MoE -> head
        L = self.layers[-1]
        nxt = op("norms_residual", lambda: self.embed[tokens[-1:]])
        cat = op("norms_residual", lambda: torch.cat([rms(nxt, L["enorm"]), rms(hidden[-1:], L["hnorm"])], -1))
        r = op("dense_fp8", lambda: L["eh"](cat, comp))
        x = op("norms_residual", lambda: rms(r, L["in_norm"]))
        a = self.mla(L, x, comp, op, pos + T)
        x = op("norms_residual", lambda: self.add_norm(a, r, L["post_norm"]))
        m = self.mlp(L, x, comp, op)
        x = op("norms_residual", lambda: self.add_norm(m, r, L["final_norm"]))
        return op("head", lambda: self.head(x, comp))


def plan_bytes_ours(pl) -> tuple[float, float]:
    """The byte model's (target verify step, NEXTN draft step with the FP8 head) bytes of a plan
    (``vllm_ling.models.cost_model.build_plan``): what the vllm-ling step's floor counts."""
    from vllm_ling.models import cost_model as P

    return P.totals(pl, "fp8")[1], pl.draft_step_bytes_without_head + pl.head_bytes["fp8"]


def class_bytes(model: Model, T: int, comp: str) -> dict[str, float]:
    """Weight and state bytes each op class must move in one step (the ops' own minimum; the
    routed experts counted from this run's routing)."""
    cfg, H = model.cfg, model.H
    out = collections.Counter()
    inter = cfg["moe_intermediate_size"]
    per_expert = 3 * H * inter // 2 + 3 * H * inter // 32
    ctx = model.context
    for L in model.layers:
        for v in L.values():
            if isinstance(v, Fp8Linear):
                out["dense_fp8"] += v.bytes
        if L["kda"]:
            out["kda_recurrent"] += 2 * L["state"].numel() * 4
            out["kda_conv_norm"] += 2 * L["conv_state"].numel() * 2
            out["small_bf16"] += L["b"].numel() * 2
        else:
            out["mla_attention"] += (ctx + T) * L["cache"].shape[1] * 2 + (L["w_uk"].numel() + L["w_uv_t"].numel()) * 2
            out["small_bf16"] += L["g"].numel() * 2
        if "experts" in L:
            out["router"] += L["router"].numel() * 4 + L["bias"].numel() * 4
            if L.get("ids") is not None:
                out["moe_routed"] += L["ids"].unique().numel() * per_expert
    V = cfg["vocab_size"]
    out["head"] = 2 * (V * H + V * 2 if comp == "ours" else V * H * 2)
    return dict(out)


def set_moe_path(model: Model, comp: str) -> None:
    """The dispatch by batch size happens at capture: 0 sends every batch to humming's GEMM."""
    for L in model.layers:
        if "experts" in L:
            L["experts"].decode_max_tokens = 32 if comp == "ours" else 0


def count_launches(fn) -> tuple[int, collections.Counter]:
    """Kernels one eager call of fn launches (torch profiler, CUDA activity)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    names = collections.Counter()
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA and "memcpy" not in e.name.lower() \
                and "memset" not in e.name.lower():
            names[e.name] += 1
    return sum(names.values()), names


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 8, 32])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--replays", type=int, default=10)
    parser.add_argument("--out", default=os.path.join(REPO, "benchmarks", "results", "decode_step_h200.md"))
    parser.add_argument("--json", default=None)
    parser.add_argument("--dense-configs", default=None,
                        help="a benchmarks/dense_fp8.py --json file: use its sweep winners instead of the table")
    args = parser.parse_args(argv)
    if args.dense_configs:
        for key, (cfg_dict, _us) in json.load(open(args.dense_configs)).get("sweep_best", {}).items():
            n, k, rows = map(int, key.split("x"))
            DENSE_CONFIGS[(n, k, rows)] = load_config(cfg_dict)
    torch.backends.cuda.matmul.allow_tf32 = False
    dev = torch.device("cuda")
    props = torch.cuda.get_device_properties(dev)
    cfg = json.load(open(CONFIG))
    copy_gbs, copy_how = copy_bandwidth_gbs()
    head = (f"device {props.name} sm_{props.major}{props.minor}, {props.multi_processor_count} SMs; copy bandwidth "
            f"{copy_gbs:.0f} GB/s ({copy_how}); torch {torch.__version__}")
    print(head, flush=True)
    model = Model(cfg, max(args.tokens), args.context, dev)
    print(f"built the full model in {model.build_s:.1f} s; GPU memory {torch.cuda.memory_allocated() / 1e9:.1f} GB; "
          f"FP8 head kernel {model.head_kernel} ({model.head_reason})", flush=True)
    from vllm_ling.models import cost_model as P
    results, notes = [], []
    gen = torch.Generator(device=dev).manual_seed(5)
    for T in args.tokens:
        tokens = torch.randint(0, cfg["vocab_size"], (T,), device=dev, generator=gen)
        pl = P.build_plan(cfg, context=args.context, verify_tokens=T)
        row = {"tokens": T}
        for comp in ("ours", "upstream"):
            set_moe_path(model, comp)
            classes = collections.Counter()

            def run_all():
                return model.step(tokens, comp, lambda cls, fn: fn())

            try:
                us = stacked_time_us([run_all], args.replays)
                for cls in sorted(STANDINS.keys() | {"dense_fp8", "moe_routed", "head"}):
                    classes[cls] = stacked_time_us([class_only(model, tokens, comp, cls)], args.replays)
                n_launch, names = count_launches(run_all)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                notes.append(f"T={T} {comp}: {type(exc).__name__}: {str(exc)[:300]}")
                continue
            row[comp] = {"us": us, "classes": dict(classes), "launches": n_launch,
                         "class_bytes": class_bytes(model, T, comp),
                         "top_kernels": names.most_common(12)}
            print(f"T={T} {comp}: {us:.0f} us/step, {n_launch} launches; "
                  + ", ".join(f"{k} {v:.0f}" for k, v in sorted(classes.items(), key=lambda t: -t[1])), flush=True)
        distinct = [int(L["ids"].unique().numel()) for L in model.layers if L.get("ids") is not None]
        # the router stand-in picks what the reference router picks (first MoE layer, this step's input)
        x_chk = torch.randn((T, cfg["hidden_size"]), device=dev, generator=gen)
        L2 = model.layers[cfg["first_k_dense_replace"]]
        kw = dict(top_k=cfg["num_experts_per_tok"], n_group=cfg["n_group"], topk_group=cfg["topk_group"],
                  routed_scaling_factor=cfg["routed_scaling_factor"])
        x_chk = x_chk.to(torch.bfloat16)
        logits_chk = (router_logits(x_chk, L2["router"]) if T <= ROUTER_MAX_ROWS
                      else F.linear(x_chk.float(), L2["router"]))
        ids_chk = grouped_topk(logits_chk, L2["bias"], **kw)[1].long()
        ids_ref = route(x_chk.float(), L2["router"], L2["bias"], **kw)[1].long()
        choice = torch.sigmoid(x_chk.float() @ L2["router"].t()) + L2["bias"]
        # another summation order may only swap experts whose biased scores tie within 1e-5
        if ((choice.gather(1, ids_chk) - choice.gather(1, ids_ref)).abs() > 1e-5).any():
            notes.append(f"T={T}: the router (GEMV + top-k stand-in) picked other experts than the reference router")
        row["plan_bytes_target"], row["plan_bytes_draft"] = plan_bytes_ours(pl)
        row["plan_bytes_upstream"] = P.totals(pl, "bf16")[1] + pl.draft_step_bytes_without_head + pl.head_bytes["bf16"]
        row["distinct_experts_mean"] = sum(distinct) / max(1, len(distinct))
        row["expected_distinct"] = pl.distinct_experts_verify
        results.append(row)
    write_outputs(render(results, head, copy_gbs, notes, model, args), args.out, args.json,
                  {"copy_gbs": copy_gbs, "device": head, "results": results, "notes": notes, "standins": STANDINS})
    return 0


def class_only(model: Model, tokens, comp: str, cls: str):
    """A step that runs only the ops of class ``cls``; every other op returns the output it
    gave in one full step run now (so the class's ops see real inputs)."""
    recorded = []
    model.step(tokens, comp, lambda c, fn: recorded.append(fn()) or recorded[-1])
    idx = [0]

    def op(c, fn):
        i = idx[0]
        idx[0] += 1
        return fn() if c == cls else recorded[i]

    def run():
        idx[0] = 0
        return model.step(tokens, comp, op)
    return run


def render(results, head, copy_gbs, notes, model, args) -> str:
    def frac(nbytes, us):
        return nbytes / (us * 1e-6) / 1e9 / copy_gbs

    lines = [f"# One Ling-3.0-flash-fp4 decode step on one GPU ({datetime.date.today().isoformat()})", "",
             f"`python -m benchmarks.decode_step {' '.join(sys.argv[1:])}`", "", head, "",
             f"Context {args.context} tokens; a step of T tokens = the target model over one sequence's T-token "
             "verify window + one NEXTN draft step (eh_proj, MLA, MoE, head) for the next position. "
             "Shared experts run on a second stream, overlapping top-k and the routed experts (vLLM 0.32's MoE "
             "runner, <= 256 tokens). "
             f"FP8 head kernel: {model.head_kernel}. Dense FP8 configs: "
             f"{'the sweep winners of ' + args.dense_configs if args.dense_configs else 'the tuned table'}. "
             "Op classes beyond the dense, MoE and head kernels (stand-ins where the serving kernel lives in vLLM, named):", ""]
    lines += [f"- {k}: {v}" for k, v in STANDINS.items()]
    lines += ["", "| T | composition | us/step | launches | plan bytes (MB) | floor us @ copy BW | step / floor | "
              "vllm-ling / upstream |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        for comp in ("ours", "upstream"):
            if comp not in r:
                continue
            nbytes = (r["plan_bytes_target"] + r["plan_bytes_draft"]) if comp == "ours" else r["plan_bytes_upstream"]
            floor = nbytes / (copy_gbs * 1e9) * 1e6
            ratio = (f"{r['upstream']['us'] / r['ours']['us']:.2f}x faster"
                     if comp == "ours" and "upstream" in r else "")
            lines.append(f"| {r['tokens']} | {'vllm-ling' if comp == 'ours' else 'upstream vLLM 0.32 (stand-ins)'} | "
                         f"{r[comp]['us']:.0f} | {r[comp]['launches']} | {nbytes / 1e6:.0f} | {floor:.0f} | "
                         f"{r[comp]['us'] / floor:.2f} | {ratio} |")
    lines += ["", "Per op class: us (a graph of that class's ops alone, the other ops' outputs replayed from a full "
              "step; class times need not add up to the step), MB the class must move (weights, state, cache), "
              "and the fraction of the copy bandwidth:", ""]
    classes = sorted({c for r in results for comp in ("ours", "upstream") if comp in r for c in r[comp]["classes"]})
    lines.append("| T | composition | " + " | ".join(classes) + " |")
    lines.append("|---|---|" + "---|" * len(classes))
    for r in results:
        for comp in ("ours", "upstream"):
            if comp not in r:
                continue
            cells = []
            for c in classes:
                us, nb = r[comp]["classes"].get(c), r[comp].get("class_bytes", {}).get(c, 0.0)
                cells.append("-" if us is None else (f"{us:.0f} us / {nb / 1e6:.0f} MB / {frac(nb, us):.2f}"
                                                      if nb else f"{us:.0f} us"))
            lines.append(f"| {r['tokens']} | {comp} | " + " | ".join(cells) + " |")
    lines += ["", "Routed experts touched per MoE layer (mean over layers, this run's routing) vs the plan's "
              "uniform-routing expectation:", ""]
    lines += [f"- T={r['tokens']}: {r['distinct_experts_mean']:.1f} vs {r['expected_distinct']:.1f}" for r in results]
    lines += ["", "Most launched kernels per step (vllm-ling):", ""]
    for r in results:
        if "ours" in r:
            lines.append(f"- T={r['tokens']}: " + "; ".join(f"{n[:60]} x{c}" for n, c in r["ours"]["top_kernels"]))
    if notes:
        lines += ["", "Notes:", ""] + [f"- {n}" for n in notes]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
