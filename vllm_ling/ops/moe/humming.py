"""Routed MXFP4 experts through humming-kernels' indexed MoE GEMM (:class:`HummingMxfp4Experts`),
with the fused decode kernels (:mod:`vllm_ling.ops.moe.decode`) for decode-sized batches.

No vLLM import (this module runs on the GPU device machine without vLLM); humming-kernels
is imported lazily, only when the humming path is built. Runs on torch 2.11 .. 2.13.
"""

from __future__ import annotations

import importlib.util
import json
import logging

import torch

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import MoeDecode, opt_out_setting, option
from vllm_ling.ops.moe.activation import (ROUTED_EXPERT_CLAMP, SwigluClamp, check_clamp, effective_limit,
                                          swiglu_activation_expr)
from vllm_ling.ops.moe.decode import layouts as decode_layouts
from vllm_ling.ops.moe.decode.shapes import MAX_GRID_ROWS
from vllm_ling.ops.moe.routing import AlignFn, moe_align_block_size, weighted_topk_sum
from vllm_ling.ops.mxfp4 import MXFP4_GROUP_SIZE

logger = get_logger("ops.moe.humming")

# Decode kernels for small batches (vllm_ling.ops.moe.decode): "auto" runs them on humming's
# own weights where supported, "copy" on a second GEMV-packed copy (faster, 2x expert memory),
# "off" never. Measured against humming's GEMM in benchmarks/results/moe_decode_h200.md.
# The decode modes and threshold are declared once, in the option table.
DECODE_AUTO, DECODE_COPY, DECODE_OFF = MoeDecode.AUTO, MoeDecode.COPY, MoeDecode.OFF
DECODE_MODES = tuple(m.value for m in MoeDecode)
DEFAULT_DECODE_MAX_TOKENS = option("VLLM_LING_MOE_DECODE_MAX_TOKENS").default


class HummingUnavailable(RuntimeError):
    """Humming cannot run here (not installed, no CUDA, GPU too old, bad dtype), or an explicit
    request of it cannot (raised before any weight loads where the selector finds out)."""


def humming_status(w4a8: bool = False, device: int | torch.device | None = None) -> tuple[bool, str]:
    """Can the humming MXFP4 MoE path run here? Checks without importing humming (its
    import starts a background build) and without compiling anything."""
    if importlib.util.find_spec("humming") is None:
        return False, ("humming-kernels is not installed (pip install humming-kernels; it "
                       "comes with vllm==0.32.0)")
    if not torch.cuda.is_available():
        return False, "CUDA is not available (humming needs an NVIDIA GPU, sm_75 or newer)"
    dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
    major, minor = torch.cuda.get_device_capability(dev)
    arch = f"sm_{major}{minor}"
    if (major, minor) < (7, 5):
        return False, f"GPU {torch.cuda.get_device_name(dev)} is {arch}; humming needs sm_75+"
    if (major, minor) < (8, 0):
        return False, (f"GPU is {arch}: humming runs there only with FP16 activations, but "
                       "the Ling MoE path uses BF16 activations, which need sm_80+")
    if w4a8 and (major, minor) < (8, 9):
        return False, f"W4A8 (FP8 e4m3 activations) needs sm_89+; this GPU is {arch}"
    from vllm_ling.versions import TESTED_HUMMING_VERSION, humming_version

    version = humming_version()
    extra = ""
    if version is not None and version != TESTED_HUMMING_VERSION:
        extra = f" (untested humming-kernels {version}; tested {TESTED_HUMMING_VERSION})"
    return True, f"humming-kernels {version} on {arch}{extra}"


def _import_humming():
    """Configure the JIT cache, then import the humming entry points we call."""
    from vllm_ling.ops.humming_cache import configure_humming_cache

    configure_humming_cache()
    try:
        from humming.forward import humming_forward, may_process_input
        from humming.schema import HummingInputSchema, HummingWeightSchema
        from humming.transform import prepare_and_transform_humming_tensors
        from humming.tune import get_heuristics_config
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise HummingUnavailable(f"cannot import humming-kernels: {exc}") from exc
    return dict(humming_forward=humming_forward, may_process_input=may_process_input,
                HummingInputSchema=HummingInputSchema, HummingWeightSchema=HummingWeightSchema,
                prepare=prepare_and_transform_humming_tensors,
                get_heuristics_config=get_heuristics_config)


def _interval_config(intervals, shape_m: int) -> dict:
    for lower, upper, config in intervals:
        if lower < shape_m <= upper:
            return config
    raise RuntimeError(f"humming has no tuning interval for shape_m={shape_m}")


class HummingMxfp4Experts:
    """Routed MXFP4 experts through humming's indexed MoE GEMM (W4A16, or W4A8 on sm_89+).

    Built once from vLLM-layout tensors (which it transforms; drop the originals after; the
    transformed tensors are in ``self.tensors["w13" | "w2"]``).
    ``forward(x, topk_weights, topk_ids, swiglu_limit)`` returns the weighted routed sum
    [T, H] in BF16 (routed_scaling_factor is expected inside ``topk_weights``, as vLLM's
    router puts it). Per call, five launches: routing metadata (one Triton kernel for
    T * top_k <= 128; above, ``prefill_align`` where given, else about 17 PyTorch ones), gate_up GEMM indexed by top-k, SwiGLU (+clamp, +FP8
    quantization for W4A8) in humming's input kernel, down GEMM, weighted top-k sum (one
    Triton kernel, fp32 weights). The steps are public methods (``routing_metadata``,
    ``gate_up``, ``activation``, ``down``, ``weighted_sum``) so they can be timed alone.
    No host synchronisation: the forward can be captured in a CUDA graph (tested).

    Decode-sized batches (``T <= decode_max_tokens``, given ``top_k``) go instead through two
    fused kernels (:mod:`vllm_ling.ops.moe.decode`): with ``decode="auto"`` they read these
    same transformed tensors (no copy; sm_90+, W4A16; where they cannot run the reason is
    logged once at WARNING and kept in ``decode_status``), with ``"copy"`` a second
    GEMV-packed copy of the experts (faster, twice the expert memory), ``"off"`` never.

    Tuning: for each batch size the entry of humming's heuristic intervals that contains
    ``shape_m = T * top_k`` is compiled alone (not the whole interval list, which would
    compile every interval's kernel on first use). ``tuning_overrides`` ({"w13": {...},
    "w2": {...}}) patches those entries (benchmark levers).
    """

    def __init__(
        self,
        w13_weight: torch.Tensor,
        w13_weight_scale: torch.Tensor,
        w2_weight: torch.Tensor,
        w2_weight_scale: torch.Tensor,
        *,
        w4a8: bool = False,
        clamp: SwigluClamp | str = ROUTED_EXPERT_CLAMP,
        routing_impl: str = "auto",
        reduce_impl: str = "auto",
        tuning_overrides: dict[str, dict] | None = None,
        param_dtype: torch.dtype = torch.bfloat16,
        top_k: int | None = None,
        decode: MoeDecode | str = DECODE_AUTO,
        decode_max_tokens: int = DEFAULT_DECODE_MAX_TOKENS,
        prefill_align: AlignFn | None = None,
    ):
        if param_dtype != torch.bfloat16:
            raise ValueError("the humming Ling MoE path supports BF16 activations only")
        clamp = check_clamp(clamp)  # benchmarks pass the plain word
        if decode not in DECODE_MODES:
            raise ValueError(f"decode must be one of {DECODE_MODES}, got {decode!r}")
        decode = MoeDecode(decode)  # benchmarks pass the plain word; compare members from here on
        if decode is not DECODE_OFF and top_k and decode_max_tokens * top_k > MAX_GRID_ROWS:
            raise ValueError(f"decode_max_tokens {decode_max_tokens} x top_k {top_k} exceeds the decode kernels' "
                             f"{MAX_GRID_ROWS} grid rows (one per token and slot)")
        for label, impl in (("routing_impl", routing_impl), ("reduce_impl", reduce_impl)):
            if impl not in ("auto", "torch", "triton"):
                raise ValueError(f"{label} must be auto, torch or triton, got {impl!r}")
        device = w13_weight.device
        ok, reason = humming_status(w4a8=w4a8, device=device if device.type == "cuda" else None)
        if not ok:
            raise HummingUnavailable(reason)
        if device.type != "cuda":
            raise HummingUnavailable(f"expert weights must be on a CUDA device, got {device}")
        for name, t in (("w13_weight", w13_weight), ("w13_weight_scale", w13_weight_scale),
                        ("w2_weight", w2_weight), ("w2_weight_scale", w2_weight_scale)):
            if t.dtype not in (torch.uint8, torch.float8_e8m0fnu) or t.dim() != 3:
                raise ValueError(f"{name} must be a 3-D uint8 tensor, got {t.dtype} {tuple(t.shape)}")
        E, two_i, half_h = w13_weight.shape
        H, I = half_h * 2, two_i // 2
        if tuple(w2_weight.shape) != (E, H, I // 2):
            raise ValueError(f"w2_weight must be [E, H, I/2] = {(E, H, I // 2)}, got {tuple(w2_weight.shape)}")
        if tuple(w13_weight_scale.shape) != (E, two_i, H // MXFP4_GROUP_SIZE):
            raise ValueError(f"w13_weight_scale shape {tuple(w13_weight_scale.shape)} != {(E, two_i, H // 32)}")
        if tuple(w2_weight_scale.shape) != (E, H, I // MXFP4_GROUP_SIZE):
            raise ValueError(f"w2_weight_scale shape {tuple(w2_weight_scale.shape)} != {(E, H, I // 32)}")

        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.w4a8 = w4a8
        self.clamp = clamp
        self.routing_impl = routing_impl
        # routing metadata above the one-launch Triton kernel's limit: a one-launch aligner where the
        # caller gives one (the layer: vLLM's CUDA op), else PyTorch's ~17 launches per call
        self.prefill_align = prefill_align
        self.reduce_impl = reduce_impl
        self.device = device
        self.tuning_overrides = tuning_overrides or {}
        hm = _import_humming()
        self.decoder = None
        self.decode_max_tokens = decode_max_tokens
        if decode is DECODE_COPY:  # needs the checkpoint-layout tensors, before humming's transform
            self.decoder = self._packed_decoder(w13_weight, w13_weight_scale, w2_weight,
                                                w2_weight_scale, top_k)
        self._forward_fn = hm["humming_forward"]
        self._process_fn = hm["may_process_input"]
        weight_schema = hm["HummingWeightSchema"](
            b_dtype="float4e2m1", bs_dtype="float8e8m0", weight_scale_group_size=MXFP4_GROUP_SIZE)
        if w4a8:
            input_schema = hm["HummingInputSchema"](a_dtype="float8e4m3",
                                                     input_quant_mode="dynamic_token")
        else:
            input_schema = hm["HummingInputSchema"]()
        self.configs = {}
        self.tensors: dict[str, dict[str, torch.Tensor]] = {}
        for sub, w, s, n, k in (("w13", w13_weight, w13_weight_scale, two_i, H),
                                ("w2", w2_weight, w2_weight_scale, H, I)):
            src = {"weight": w.contiguous().view(torch.uint8).view(torch.int32),
                   "weight_scale": s.contiguous().view(torch.uint8).view(torch.float8_e8m0fnu)}
            cfg, out = hm["prepare"](src, shape_n=n, shape_k=k, weight_schema=weight_schema,
                                     input_schema=input_schema, num_experts=E,
                                     pad_n_to_multiple=256, pad_k_to_multiple=128,
                                     torch_dtype=torch.bfloat16, device=device)
            self.configs[sub] = cfg
            self.tensors[sub] = out
        self.compute_config = json.dumps({"use_batch_invariant": False, "use_f16_accum": False,
                                          "gemm_type": "indexed"})
        self.intervals = {
            sub: hm["get_heuristics_config"](self.configs[sub], use_f16_accum=False,
                                             use_batch_invariant=False, gemm_type="indexed",
                                             device=device)
            for sub in ("w13", "w2")}
        num_sms = torch.cuda.get_device_properties(device).multi_processor_count
        # humming's stream-K / split reduction workspace, sized as vLLM does.
        self.locks = torch.zeros(num_sms * 8, dtype=torch.int32, device=device)
        self._plans: dict[int, dict] = {}
        self._compiled: set[tuple] = set()
        log_once(logger, logging.INFO, f"humming-moe-{w4a8}",
                 "Humming MXFP4 MoE: %d experts, hidden %d, intermediate %d, %s, indexed GEMM",
                 E, H, I, "W4A8 (FP8 e4m3 per-token activations)" if w4a8 else "W4A16 (BF16 activations)")
        if decode is DECODE_AUTO:
            self.decoder = self._humming_layout_decoder(top_k)
        if decode is DECODE_OFF:
            self.decode_status = f"off ({opt_out_setting('VLLM_LING_MOE_DECODE')}): humming's GEMM at every batch size"
        elif self.decoder is not None:
            self.decode_status = (f"{'packed copy' if decode is DECODE_COPY else 'humming layout'}, "
                                  f"<= {decode_max_tokens} tokens")

    # -- decode kernels ---------------------------------------------------------------------
    def _humming_layout_decoder(self, top_k: int | None):
        """Fused decode kernels on humming's tensors, or None (logged once with the reason)."""
        if top_k is None:
            self.decode_status = "off: top_k not given"
            return None
        ok, reason = decode_layouts.humming_decode_support(self, top_k)
        if not ok:
            self.decode_status = f"unavailable: {reason}"
            log_once(logger, logging.WARNING, f"moe-decode-off-{reason}",
                     "MoE decode kernels unavailable (%s): batches <= %d tokens run humming's "
                     "slower indexed GEMM (benchmarks/results/moe_decode_h200.md compares them).",
                     reason, self.decode_max_tokens)
            return None
        decoder = decode_layouts.HummingLayoutDecode(self, top_k)
        log_once(logger, logging.INFO, "moe-decode-humming",
                 "MoE decode kernels: batches <= %d tokens run two fused kernels on humming's "
                 "weights (gate_up+SwiGLU, down+top-k sum).", self.decode_max_tokens)
        return decoder

    def _packed_decoder(self, w13, s13, w2, s2, top_k: int | None):
        """The ``copy`` mode: a second, GEMV-packed copy of the experts (explicitly requested,
        so failures raise)."""
        if top_k is None:
            raise ValueError("decode='copy' needs top_k")
        decoder = decode_layouts.PackedLayoutDecode(w13, s13, w2, s2, top_k=top_k, clamp=self.clamp)
        log_once(logger, logging.INFO, "moe-decode-copy",
                 "MoE decode kernels on a packed copy of the experts (VLLM_LING_MOE_DECODE=copy): "
                 "+%.1f MB per layer on top of humming's copy, batches <= %d tokens.",
                 decoder.nbytes / 1e6, self.decode_max_tokens)
        return decoder

    # -- tuning -------------------------------------------------------------------------
    def set_tuning_overrides(self, overrides: dict[str, dict] | None) -> None:
        """Replace the per-GEMM patches of humming's heuristic entries (new kernels are
        compiled on next use)."""
        self.tuning_overrides = overrides or {}
        self._plans.clear()
        self._compiled.clear()

    def plan(self, num_assignments: int) -> dict:
        """Tuning entries (and their JSON) for shape_m = T * top_k."""
        plan = self._plans.get(num_assignments)
        if plan is None:
            plan = {}
            for sub in ("w13", "w2"):
                cfg = dict(_interval_config(self.intervals[sub], num_assignments))
                cfg.update(self.tuning_overrides.get(sub, {}))
                plan[sub] = cfg
                plan[sub + "_json"] = json.dumps(cfg, sort_keys=True)
                plan[sub + "_block"] = int(cfg["block_shape"][0])
            self._plans[num_assignments] = plan
        return plan

    # -- forward ------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16:
            raise ValueError(f"hidden states must be bfloat16, got {x.dtype}")
        if x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be [T, {self.hidden_size}], got {tuple(x.shape)}")
        T, top_k = topk_ids.shape
        if self.decoder is not None and 0 < T <= self.decode_max_tokens and top_k == self.decoder.top_k:
            return self.decoder(x, topk_weights, topk_ids, swiglu_limit)
        plan = self.plan(T * top_k)
        key = (T * top_k, effective_limit(swiglu_limit))
        if key in self._compiled:
            return self._forward(x, topk_weights, topk_ids, swiglu_limit, plan)
        # First use of this shape/limit may JIT-compile: serialise with other processes
        # sharing the cache so only one of them compiles each kernel.
        from vllm_ling.ops.humming_cache import compile_lock

        with compile_lock():
            out = self._forward(x, topk_weights, topk_ids, swiglu_limit, plan)
        self._compiled.add(key)
        return out

    __call__ = forward

    def _forward(self, x, topk_weights, topk_ids, swiglu_limit, plan) -> torch.Tensor:
        T, top_k = topk_ids.shape
        align13, align2 = self.routing_metadata(topk_ids, plan)
        gate_up = self.gate_up(x.contiguous(), align13, plan, top_k)
        act, s2, s2_2 = self.activation(gate_up, swiglu_limit)
        down = self.down(act, s2, s2_2, align2, plan)
        return self.weighted_sum(down, topk_weights)

    # The steps of one forward, public so benchmarks can time them one by one.
    def routing_metadata(self, topk_ids, plan):
        align13 = moe_align_block_size(topk_ids, plan["w13_block"], self.num_experts, self.routing_impl,
                                       self.prefill_align)
        if plan["w2_block"] == plan["w13_block"]:
            return align13, align13
        return align13, moe_align_block_size(topk_ids, plan["w2_block"], self.num_experts,
                                             self.routing_impl, self.prefill_align)

    def gate_up(self, x, align, plan, top_k):
        cfg, w = self.configs["w13"], self.tensors["w13"]
        n = x.shape[0] * top_k
        a, s, s_2 = self._quantize_input(cfg, x)
        out = torch.empty(n, 2 * self.intermediate_size, dtype=torch.bfloat16, device=x.device)
        self._forward_fn(cfg, inputs=a, weight=w["weight"], weight_scale=w["weight_scale"],
                         weight_scale_2=w.get("weight_scale_2"), input_scale=s, input_scale_2=s_2,
                         outputs=out, sorted_ids=align[0], expert_ids=align[1],
                         num_tokens_padded=align[2], locks=self.locks, top_k=top_k,
                         valid_shape_m=n, compute_config=self.compute_config,
                         tuning_config=plan["w13_json"])
        return out

    def activation(self, gate_up, swiglu_limit):
        """SwiGLU (+clamp) in humming's input kernel; for W4A8 it also quantizes to FP8."""
        mode = self.configs["w2"].input_quant_mode
        act, group_scales, token_scales = self._process_fn(
            self.configs["w2"], inputs=gate_up, activation_type="binary_split",
            activation_impl=swiglu_activation_expr(swiglu_limit, self.clamp))
        s = group_scales if mode.has_group_scale else token_scales
        s_2 = token_scales if mode.has_secondary_scale else None
        return act, s, s_2

    def down(self, act, s, s_2, align, plan):
        cfg, w = self.configs["w2"], self.tensors["w2"]
        n = act.shape[0]
        out = torch.empty(n, self.hidden_size, dtype=torch.bfloat16, device=act.device)
        self._forward_fn(cfg, inputs=act, weight=w["weight"], weight_scale=w["weight_scale"],
                         weight_scale_2=w.get("weight_scale_2"), input_scale=s, input_scale_2=s_2,
                         outputs=out, sorted_ids=align[0], expert_ids=align[1],
                         num_tokens_padded=align[2], locks=self.locks, top_k=1, valid_shape_m=n,
                         compute_config=self.compute_config, tuning_config=plan["w2_json"])
        return out

    def weighted_sum(self, down, topk_weights):
        return weighted_topk_sum(down, topk_weights, self.reduce_impl)

    def _quantize_input(self, cfg, x):
        mode = cfg.input_quant_mode
        if not mode.should_quantize:
            return x, None, None
        q, group_scales, token_scales = self._process_fn(cfg, inputs=x)
        scale = group_scales if mode.has_group_scale else token_scales
        scale_2 = token_scales if mode.has_secondary_scale else None
        return q, scale, scale_2


