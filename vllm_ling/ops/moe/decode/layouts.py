"""The two decoders: :class:`HummingLayoutDecode` (the default, on humming's own weights) and
:class:`PackedLayoutDecode` (on a GEMV-packed copy), both gate_up (+SwiGLU) then down
(+weighted top-k sum) in two fused kernel launches. See :mod:`vllm_ling.ops.moe.decode`."""

from __future__ import annotations

import ctypes

import torch

from vllm_ling.ops.cuda_jit import compiled_kernel, launch
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, SwigluClamp, check_clamp, clamp_define, effective_limit
from vllm_ling.ops.moe.decode.packing import TILE_ROWS, check_shapes, pack_down, pack_gate_up
from vllm_ling.ops.moe.decode.shapes import (HummingDecodeConfig, KernelShape, PackedDecodeConfig,
                                             default_humming_decode_configs)
from vllm_ling.ops.moe.decode.sources import packed_layout_source

GATE_UP_ARG_TYPES = (ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p,
                     ctypes.c_void_p, ctypes.c_float, ctypes.c_int)
DOWN_ARG_TYPES = (ctypes.c_void_p,) * 6


def _limit(swiglu_limit: float | None) -> tuple[float, int]:
    limit = effective_limit(swiglu_limit)
    return (0.0, 0) if limit is None else (float(limit), 1)


class _TwoKernelDecode:
    """Shared forward of both decode variants: gate_up (+SwiGLU) then down (+top-k sum)."""

    hidden_size: int
    intermediate_size: int
    top_k: int

    def _check(self, x: torch.Tensor, topk_ids: torch.Tensor) -> None:
        H, K = self.hidden_size, self.top_k
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != H:
            raise ValueError(f"hidden states must be bfloat16 [T, {H}], got {x.dtype} {tuple(x.shape)}")
        if tuple(topk_ids.shape) != (x.shape[0], K):
            raise ValueError(f"topk_ids must be [{x.shape[0]}, {K}], got {tuple(topk_ids.shape)}")

    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        """SwiGLU(x @ w13[e].T) per assignment: BF16 [T * top_k, I] (row = token * k + slot)."""
        self._check(x, topk_ids)
        x = x.contiguous()
        if x.data_ptr() % 16:
            x = x.clone()
        ids = topk_ids.to(torch.int32).contiguous()
        act = torch.empty(x.shape[0] * self.top_k, self.intermediate_size, dtype=torch.bfloat16,
                          device=x.device)
        if x.shape[0]:
            self._launch_gate_up(x, ids, act, *_limit(swiglu_limit),
                                 torch.cuda.current_stream(x.device).cuda_stream)
        return act

    def down(self, act: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """sum over slots of topk_weights * (act @ w2[e].T): BF16 [T, H]."""
        ids = topk_ids.to(torch.int32).contiguous()
        w = topk_weights.to(torch.float32).contiguous()
        out = torch.empty(ids.shape[0], self.hidden_size, dtype=torch.bfloat16, device=act.device)
        if ids.shape[0]:
            self._launch_down(act, w, ids, out, torch.cuda.current_stream(act.device).cuda_stream)
        return out

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        ids = topk_ids.to(torch.int32).contiguous()
        return self.down(self.gate_up(x, ids, swiglu_limit), topk_weights, ids)

    __call__ = forward


# ---------------------------------------------------------------------------------------
# Variant 1: vllm-ling's own packed copy of the weights
# ---------------------------------------------------------------------------------------

class PackedLayoutDecode(_TwoKernelDecode):
    """Routed MXFP4 experts for decode-sized batches on a packed copy of the weights made for
    GEMV (:func:`pack_gate_up` / :func:`pack_down`: each lane's 16 bytes are its MMA
    fragments of 16 rows x 64 k; 8 codes decode in 9 integer instructions).

    The copy is as large as the checkpoint's expert weights; humming keeps its own copy for
    larger batches, so this doubles the routed-expert memory (the ``copy`` decode mode).
    Inputs are vLLM-layout tensors (uint8 codes [E, 2I, H/2] / [E, H, I/2], E8M0 scales).
    """

    def __init__(self, w13_weight: torch.Tensor, w13_weight_scale: torch.Tensor,
                 w2_weight: torch.Tensor, w2_weight_scale: torch.Tensor, *, top_k: int,
                 clamp: SwigluClamp | str = ROUTED_EXPERT_CLAMP, config: PackedDecodeConfig | None = None):
        if w13_weight.device.type != "cuda":
            raise ValueError(f"expert weights must be on a CUDA device, got {w13_weight.device}")
        E, H, I = check_shapes(w13_weight, w13_weight_scale, w2_weight, w2_weight_scale)
        self.num_experts, self.hidden_size, self.intermediate_size, self.top_k = E, H, I, top_k
        self.device, self.clamp = w13_weight.device, check_clamp(clamp)
        self.w13, self.s13 = pack_gate_up(w13_weight, w13_weight_scale)
        self.w2, self.s2 = pack_down(w2_weight, w2_weight_scale)
        self.nbytes = sum(t.numel() * t.element_size() for t in (self.w13, self.s13, self.w2, self.s2))
        self._build(config or PackedDecodeConfig())

    def _build(self, config: PackedDecodeConfig) -> None:
        self.config = config
        self.use_pdl = config.use_pdl and torch.cuda.get_device_capability(self.device)[0] >= 9
        src = packed_layout_source(self.hidden_size, self.intermediate_size, self.top_k, config,
                                   clamp_define(self.clamp))
        self._gate_up = compiled_kernel("ling_moe_decode_gate_up", src, self.device)
        self._down = compiled_kernel("ling_moe_decode_down", src, self.device)

    def with_config(self, config: PackedDecodeConfig) -> "PackedLayoutDecode":
        """The same packed weights with other launch shapes (benchmark levers)."""
        other = object.__new__(PackedLayoutDecode)
        other.__dict__.update(self.__dict__)
        other._build(config)
        return other

    def _launch_gate_up(self, x, ids, act, limit, has_limit, stream):
        c = self.config
        launch(self._gate_up, (self.intermediate_size // TILE_ROWS, ids.numel()), c.k_split_gate_up * 32,
                (self.w13.data_ptr(), self.s13.data_ptr(), x.data_ptr(), ids.data_ptr(),
                 act.data_ptr(), limit, has_limit), GATE_UP_ARG_TYPES, stream)

    def _launch_down(self, act, w, ids, out, stream):
        launch(self._down, (self.hidden_size // TILE_ROWS, ids.shape[0]),
                self.top_k * self.config.k_split_down * 32,
                (self.w2.data_ptr(), self.s2.data_ptr(), act.data_ptr(), ids.data_ptr(),
                 w.data_ptr(), out.data_ptr()), DOWN_ARG_TYPES, stream, pdl=self.use_pdl)



# ---------------------------------------------------------------------------------------
# Default: humming's own transformed weights, no copy
# ---------------------------------------------------------------------------------------

def humming_decode_support(experts, top_k: int) -> tuple[bool, str]:
    """Can the decode kernels read this HummingMxfp4Experts' tensors? (reason if not)"""
    if experts.w4a8:
        return False, "W4A8 layer (FP8 activations use humming's fused-scale layout)"
    if not 1 <= top_k <= 8:
        return False, f"top_k {top_k} outside 1..8 (one cluster CTA per slot, portable cluster size 8)"
    H, I = experts.hidden_size, experts.intermediate_size
    if H % 64 or I % 64:
        return False, f"hidden {H} / intermediate {I} not multiples of 64"
    major, minor = torch.cuda.get_device_capability(experts.device)
    if major < 9:
        return False, f"sm_{major}{minor} has no thread-block clusters (the kernels need sm_90+)"
    for sub, (n, k) in (("w13", (2 * I, H)), ("w2", (H, I))):
        cfg, t = experts.configs[sub], experts.tensors[sub]
        odd = [name for name in ("use_raw_weight", "use_flat_weight", "use_native_dequant",
                                 "use_packed_k_layout", "use_fused_e8m0_scale", "use_ldmatrix_dequant",
                                 "use_block_scaled_mma", "should_apply_bs_on_c", "use_int_weight_scale")
               if getattr(cfg, name)]
        if odd or cfg.pad_shape_n or cfg.pad_shape_k or "weight_scale_2" in t:
            return False, f"{sub}: humming chose another layout ({', '.join(odd) or 'padding or a secondary scale'})"
        E = experts.num_experts
        if tuple(t["weight"].shape) != (E, k // 16, 2 * n) or tuple(t["weight_scale"].shape) != (E, k // 32, n):
            return False, (f"{sub}: unexpected humming tensor shapes {tuple(t['weight'].shape)} / "
                           f"{tuple(t['weight_scale'].shape)}")
        for name in ("weight", "weight_scale"):  # read as raw rows, bulk-copied in 16-byte units
            if not t[name].is_contiguous() or t[name].data_ptr() % 16:
                return False, f"{sub} {name} is not a contiguous, 16-byte aligned tensor"
    limit = torch.cuda.get_device_properties(experts.device).shared_memory_per_block_optin
    for key, cfg in default_humming_decode_configs(H, I).items():
        problems = cfg.problems(H, I, top_k, limit)
        if problems:
            return False, f"launch shape for {key} token(s): {'; '.join(problems)}"
    return True, "fused decode kernels on humming's W4A16 layout"


class HummingLayoutDecode(_TwoKernelDecode):
    """Decode-sized batches of a :class:`~vllm_ling.ops.moe.humming.HummingMxfp4Experts` layer in two
    fused kernels that read humming's own transformed weights (no second copy): gate_up +
    SwiGLU (a cluster of CTAs splits K and reduces in distributed shared memory), then down
    + weighted top-k sum (one CTA per top-k slot in a cluster). Each kernel comes in two
    forms (weights into registers, or streamed through shared memory); ``configs`` picks them
    per token count ("one", "many"). CUDA-graph capturable."""

    def __init__(self, experts, top_k: int, configs: dict[str, HummingDecodeConfig] | None = None):
        ok, reason = humming_decode_support(experts, top_k)
        if not ok:
            raise ValueError(f"humming-layout decode kernels cannot run: {reason}")
        self.experts, self.top_k = experts, top_k
        self.hidden_size, self.intermediate_size = experts.hidden_size, experts.intermediate_size
        self.device = experts.device
        self._has_pdl = torch.cuda.get_device_capability(self.device)[0] >= 9
        self._smem_limit = torch.cuda.get_device_properties(self.device).shared_memory_per_block_optin
        w13, w2 = experts.tensors["w13"], experts.tensors["w2"]
        self._w13, self._s13 = w13["weight"], w13["weight_scale"]
        self._w2, self._s2 = w2["weight"], w2["weight_scale"]
        self.configs = configs or default_humming_decode_configs(self.hidden_size, self.intermediate_size)
        self._kernels = {key: self._build(c) for key, c in self.configs.items()}

    def _build(self, c: HummingDecodeConfig):
        H, I, K = self.hidden_size, self.intermediate_size, self.top_k
        problems = c.problems(H, I, K, self._smem_limit)
        if problems:
            raise ValueError(f"launch shape {c} cannot run hidden {H} / intermediate {I}: {'; '.join(problems)}")
        clamp = clamp_define(self.experts.clamp)
        return (c, *(compiled_kernel(shape.kernel_name, shape.source(H, I, K, clamp), self.device)
                     for shape in (c.gate_up, c.down)))

    def with_config(self, config: "HummingDecodeConfig | dict[str, HummingDecodeConfig]") -> "HummingLayoutDecode":
        """Other launch shapes on the same weights (benchmark levers): one config for every
        token count, or a {"one": ..., "many": ...} dict."""
        configs = config if isinstance(config, dict) else {"one": config, "many": config}
        return HummingLayoutDecode(self.experts, self.top_k, configs)

    def _pick(self, num_tokens: int):
        return self._kernels["one" if num_tokens == 1 else "many"]

    def _launch_shape(self, shape: KernelShape, kernel, rows: int, args, arg_types, stream, pdl: bool):
        H, I, K = self.hidden_size, self.intermediate_size, self.top_k
        launch(kernel, (shape.grid_x(H, I, K), rows), shape.threads(H, I), args, arg_types, stream,
                cluster=shape.cluster_size(K), pdl=pdl, smem=shape.smem(H, I, K))

    def _launch_gate_up(self, x, ids, act, limit, has_limit, stream):
        c, gate_up, _ = self._pick(x.shape[0])
        self._launch_shape(c.gate_up, gate_up, ids.numel(),
                           (self._w13.data_ptr(), self._s13.data_ptr(), x.data_ptr(), ids.data_ptr(),
                            act.data_ptr(), limit, has_limit), GATE_UP_ARG_TYPES, stream,
                           pdl=c.use_pdl and self._has_pdl)

    def _launch_down(self, act, w, ids, out, stream):
        c, _, down = self._pick(ids.shape[0])
        self._launch_shape(c.down, down, ids.shape[0],
                           (self._w2.data_ptr(), self._s2.data_ptr(), act.data_ptr(), ids.data_ptr(),
                            w.data_ptr(), out.data_ptr()), DOWN_ARG_TYPES, stream, pdl=c.use_pdl and self._has_pdl)
