"""Triton MXFP4 fused-MoE decode path for small batches (T * top_k <= 32 assignments).

Why: at 1-4 tokens a Ling MoE layer is a set of GEMVs (8 experts x 3 matrices per token);
humming's indexed GEMM spends ~30 us per layer at 1 token on 25 MB (0.20 of the copy
bandwidth, see benchmarks/results/moe_stacked_h200.md). Two launches here, each spread
over every SM even at 1 token:

1. ``_gate_up_swiglu``: grid (assignment, I / BLOCK_I). One program reads BLOCK_I gate rows
   and the matching BLOCK_I up rows of expert ``topk_ids.flat[a]``, multiplies them with
   x[token], applies SwiGLU with vLLM's routed-expert clamp
   ``silu(min(g, L)) * clamp(u, -L, L)`` and writes act [T*top_k, I] (BF16).
2. ``_down_weighted_sum``: grid (token, H / BLOCK_H). One program takes BLOCK_H rows of
   w2 from *each* of the token's top-k experts as one tile (top_k * BLOCK_H rows, all
   loads in flight together), multiplies them with the matching act rows (act of slot j
   in MMA column j), scales by the top-k weights and sums in registers (no atomics, no
   zero-fill, deterministic), then writes out [T, H] in BF16.

Weights stay in vLLM's MXFP4 layout, no transform (rows are contiguous along K, which is
what a GEMV streams): ``w13_weight`` uint8 [E, 2I, H/2] (gate rows then up rows; element 2i
in the low nibble), ``w13_weight_scale`` uint8 E8M0 [E, 2I, H/32], ``w2_weight`` uint8
[E, H, I/2], ``w2_weight_scale`` uint8 [E, H, I/32].

Dequantisation ``mode``:
- ``"dot_scaled"``: ``tl.dot_scaled`` (e2m1 weights x BF16 activations, E8M0 scales); on
  Hopper Triton upcasts the e2m1 tile to BF16 in registers with its own bit tricks and
  runs an MMA; the vector is padded to 16 columns (only column 0 is real).
- ``"dequant_dot"``: our own e2m1 -> fp32 decode (bit pattern for codes >= 2, 0 / 0.5
  otherwise; exact), times the power-of-two scale, rounded to BF16 (exact: e2m1 x 2**k fits
  BF16) and fed to ``tl.dot`` with the same 16-column padding.
- ``"dequant_fma"``: the same decode, fp32 multiply-add on CUDA cores (no padding waste,
  no BF16 rounding of the weights, more ALU work per byte).

No host synchronisation and no data-dependent shapes: the forward is CUDA-graph capturable.
E8M0 exponent 0 (2**-127) decodes to 0 and 255 (NaN) to +inf in the dequant modes; real
checkpoints use neither. No vLLM import; Triton is imported lazily.
"""

from __future__ import annotations

import os

import torch

MXFP4_GROUP = 32
MODES = ("dot_scaled", "dequant_dot", "dequant_fma")
_MODE_ID = {m: i for i, m in enumerate(MODES)}
DEFAULT_MAX_ASSIGNMENTS = 32
# Minimum MMA width: the single activation column is padded to this many (zero) columns.
_N_PAD = 16

try:  # guarded: the module imports (and reports why) without Triton
    import triton
    import triton.language as tl
    _TRITON_IMPORT_ERROR: Exception | None = None
except Exception as _exc:  # ImportError, or a broken install raising at import
    triton = tl = None
    _TRITON_IMPORT_ERROR = _exc

# Triton resolves @jit helpers through module globals, so the kernels live at module level;
# TRITON_INTERPRET is read when they are decorated (i.e. at import).
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")

if triton is not None:

    @triton.jit
    def _decode_e2m1_scaled(packed, scale_u8, ROWS: tl.constexpr, BLOCK_K: tl.constexpr):
        """uint8 [ROWS, BLOCK_K/2] + E8M0 uint8 [ROWS, BLOCK_K/32] -> fp32 [ROWS, BLOCK_K]."""
        codes = tl.join(packed & 0xF, packed >> 4).reshape(ROWS, BLOCK_K)  # low nibble first
        c = (codes & 7).to(tl.int32)
        # codes 2..7 are normal floats 2**(e-1) * (1 + m/2): put (e, m) in the fp32 exponent
        # low bits / mantissa top bit and add the bias of 2**-1; codes 0, 1 are 0 and 0.5.
        normal = ((c << 22) + 0x3F000000).to(tl.float32, bitcast=True)
        mag = tl.where(c >= 2, normal, c.to(tl.float32) * 0.5)
        val = tl.where((codes & 8) != 0, -mag, mag)
        scale = (scale_u8.to(tl.int32) << 23).to(tl.float32, bitcast=True)  # 2**(s-127)
        val = val.reshape(ROWS, BLOCK_K // 32, 32) * scale[:, :, None]
        return val.reshape(ROWS, BLOCK_K)

    @triton.jit
    def _rows_times_vector(w_ptrs, s_ptrs, v_ptrs, v_mask, acc,
                           ROWS: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr):
        """acc (+)= W[ROWS, BLOCK_K] @ v for one K tile (acc [ROWS, 16] or [ROWS])."""
        packed = tl.load(w_ptrs)
        scale = tl.load(s_ptrs)
        if MODE == 0:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)  # [BLOCK_K, 16], column 0 real
            acc = tl.dot_scaled(packed, scale, "e2m1", v, None, "bf16", acc)
        elif MODE == 1:
            v = tl.load(v_ptrs, mask=v_mask, other=0.0)
            w = _decode_e2m1_scaled(packed, scale, ROWS, BLOCK_K).to(tl.bfloat16)
            acc = tl.dot(w, v, acc)
        else:
            v = tl.load(v_ptrs).to(tl.float32)  # [BLOCK_K]
            w = _decode_e2m1_scaled(packed, scale, ROWS, BLOCK_K)
            acc += tl.sum(w * v[None, :], axis=1)
        return acc

    @triton.jit
    def _gate_up_swiglu(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, limit,
                        H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                        BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, MODE: tl.constexpr,
                        HAS_LIMIT: tl.constexpr, N_PAD: tl.constexpr):
        a = tl.program_id(0)
        pid_i = tl.program_id(1)
        tok = a // TOP_K
        e = tl.load(ids_ptr + a).to(tl.int64)
        rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        kb = tl.arange(0, BLOCK_K // 2)
        ks = tl.arange(0, BLOCK_K // 32)
        kx = tl.arange(0, BLOCK_K)
        w_gate = w_ptr + e * (2 * I * (H // 2)) + rows[:, None] * (H // 2) + kb[None, :]
        s_gate = s_ptr + e * (2 * I * (H // 32)) + rows[:, None] * (H // 32) + ks[None, :]
        w_up = w_gate + I * (H // 2)
        s_up = s_gate + I * (H // 32)
        x_row = x_ptr + tok.to(tl.int64) * H
        if MODE == 2:
            v_ptrs = x_row + kx
            v_mask = None
            acc_g = tl.zeros((BLOCK_I,), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_I,), dtype=tl.float32)
        else:
            cols = tl.arange(0, N_PAD)
            v_ptrs = x_row + kx[:, None] + cols[None, :] * 0
            v_mask = (cols[None, :] == 0) & (kx[:, None] >= 0)
            acc_g = tl.zeros((BLOCK_I, N_PAD), dtype=tl.float32)
            acc_u = tl.zeros((BLOCK_I, N_PAD), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            acc_g = _rows_times_vector(w_gate + k0 // 2, s_gate + k0 // 32, v_ptrs + k0, v_mask,
                                       acc_g, BLOCK_I, BLOCK_K, MODE)
            acc_u = _rows_times_vector(w_up + k0 // 2, s_up + k0 // 32, v_ptrs + k0, v_mask,
                                       acc_u, BLOCK_I, BLOCK_K, MODE)
        if MODE == 2:
            g = acc_g
            u = acc_u
        else:  # only column 0 is non-zero
            g = tl.sum(acc_g, axis=1)
            u = tl.sum(acc_u, axis=1)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + a.to(tl.int64) * I + rows, act.to(act_ptr.dtype.element_ty))

    @triton.jit
    def _down_weighted_sum(act_ptr, ids_ptr, topk_w_ptr, w_ptr, s_ptr, out_ptr,
                           H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                           TOP_K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                           BLOCK_K: tl.constexpr, MODE: tl.constexpr, N_PAD: tl.constexpr):
        # One tile of TOP_K_PAD * BLOCK_H weight rows: BLOCK_H output rows of each of the
        # token's top-k experts, so every K step has all experts' loads in flight at once.
        tok = tl.program_id(0)
        pid_h = tl.program_id(1)
        ROWS: tl.constexpr = TOP_K_PAD * BLOCK_H
        r = tl.arange(0, ROWS)
        slot = r // BLOCK_H
        h = pid_h * BLOCK_H + r % BLOCK_H
        valid = slot < TOP_K
        a_row = tok * TOP_K + slot
        e = tl.load(ids_ptr + a_row, mask=valid, other=0).to(tl.int64)
        kb = tl.arange(0, BLOCK_K // 2)
        ks = tl.arange(0, BLOCK_K // 32)
        kx = tl.arange(0, BLOCK_K)
        w_ptrs = w_ptr + e[:, None] * (H * (I // 2)) + h[:, None] * (I // 2) + kb[None, :]
        s_ptrs = s_ptr + e[:, None] * (H * (I // 32)) + h[:, None] * (I // 32) + ks[None, :]
        row_mask = valid[:, None]
        if MODE == 2:
            v_ptrs = act_ptr + a_row[:, None].to(tl.int64) * I + kx[None, :]  # [ROWS, BLOCK_K]
            acc = tl.zeros((ROWS,), dtype=tl.float32)
        else:
            # column j of the activation tile is act[token's slot j]; row block j of the
            # result uses only column j
            cols = tl.arange(0, N_PAD)
            v_ptrs = act_ptr + (tok * TOP_K + cols[None, :]).to(tl.int64) * I + kx[:, None]
            v_mask = (cols[None, :] < TOP_K) & (kx[:, None] >= 0)
            acc = tl.zeros((ROWS, N_PAD), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            packed = tl.load(w_ptrs + k0 // 2, mask=row_mask, other=0)
            scale = tl.load(s_ptrs + k0 // 32, mask=row_mask, other=0)
            if MODE == 0:
                v = tl.load(v_ptrs + k0, mask=v_mask, other=0.0)
                acc = tl.dot_scaled(packed, scale, "e2m1", v, None, "bf16", acc)
            elif MODE == 1:
                v = tl.load(v_ptrs + k0, mask=v_mask, other=0.0)
                w = _decode_e2m1_scaled(packed, scale, ROWS, BLOCK_K).to(tl.bfloat16)
                acc = tl.dot(w, v, acc)
            else:
                v = tl.load(v_ptrs + k0, mask=row_mask, other=0.0).to(tl.float32)
                w = _decode_e2m1_scaled(packed, scale, ROWS, BLOCK_K)
                acc += tl.sum(w * v, axis=1)
        weight = tl.load(topk_w_ptr + a_row, mask=valid, other=0.0).to(tl.float32)
        if MODE == 2:
            y_rows = acc * weight
        else:
            y_rows = tl.sum(tl.where(cols[None, :] == slot[:, None], acc, 0.0), axis=1) * weight
        y = tl.sum(tl.reshape(y_rows, (TOP_K_PAD, BLOCK_H)), axis=0)
        out_rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(out_ptr + tok.to(tl.int64) * H + out_rows, y.to(out_ptr.dtype.element_ty))


def triton_decode_available(device: torch.device | str | int | None = None) -> tuple[bool, str]:
    """(True, "") if the Triton decode path can run on ``device`` (default: the current
    CUDA device), else (False, reason). CPU tensors are accepted only under
    TRITON_INTERPRET=1 (set before this module is imported), for tests."""
    if triton is None:
        return False, f"triton is not importable: {_TRITON_IMPORT_ERROR!r}"
    if not hasattr(tl, "dot_scaled"):
        return False, f"triton {triton.__version__} has no tl.dot_scaled (need >= 3.3)"
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    if dev.type == "cpu" and _INTERPRETED:
        return True, ""
    if dev.type != "cuda":
        return False, (f"device {dev} is not CUDA (TRITON_INTERPRET=1 at import runs the kernels "
                       "on CPU, for tests only)")
    if not torch.cuda.is_available():
        return False, "torch.cuda.is_available() is False"
    major, minor = torch.cuda.get_device_capability(dev)
    if (major, minor) < (8, 0):
        return False, f"sm_{major}{minor} has no BF16 MMA; the Triton decode path needs sm_80 or newer"
    return True, ""


def _get_kernels():
    if triton is None:
        raise RuntimeError(f"triton is not importable: {_TRITON_IMPORT_ERROR!r}")
    return _gate_up_swiglu, _down_weighted_sum


def _check_weights(w13_weight, w13_weight_scale, w2_weight, w2_weight_scale):
    for name, t in (("w13_weight", w13_weight), ("w13_weight_scale", w13_weight_scale),
                    ("w2_weight", w2_weight), ("w2_weight_scale", w2_weight_scale)):
        if t.dtype not in (torch.uint8, getattr(torch, "float8_e8m0fnu", torch.uint8)) or t.dim() != 3:
            raise ValueError(f"{name} must be a 3-D uint8 tensor in vLLM's MXFP4 MoE layout, "
                             f"got {t.dtype} {tuple(t.shape)}")
    E, two_i, half_h = w13_weight.shape
    H, I = 2 * half_h, two_i // 2
    expected = {"w13_weight_scale": (E, two_i, H // MXFP4_GROUP), "w2_weight": (E, H, I // 2),
                "w2_weight_scale": (E, H, I // MXFP4_GROUP)}
    got = {"w13_weight_scale": w13_weight_scale, "w2_weight": w2_weight,
           "w2_weight_scale": w2_weight_scale}
    for name, shape in expected.items():
        if tuple(got[name].shape) != shape:
            raise ValueError(f"{name} must be {shape} for w13_weight {tuple(w13_weight.shape)}, "
                             f"got {tuple(got[name].shape)}")
    return E, H, I




class TritonMxfp4DecodeExperts:
    """Routed experts of one MoE layer for decode batches, in two Triton launches.

    ``forward(x [T, H] bf16, topk_weights [T, k] float, topk_ids [T, k] int) -> [T, H] bf16``
    (the weighted sum over the top-k experts, without the shared expert). ``swiglu_limit``
    None/0 means no clamp. Refuses T * k above ``max_assignments`` (the path is tuned for
    decode; use the humming path for larger batches).
    """

    def __init__(self, w13_weight, w13_weight_scale, w2_weight, w2_weight_scale, *,
                 mode: str = "dot_scaled", block_i: int = 16, block_h: int = 8,
                 block_k_gate_up: int = 256, block_k_down: int = 256,
                 num_warps: int = 4, num_stages: int = 3,
                 act_dtype: torch.dtype = torch.bfloat16,
                 max_assignments: int = DEFAULT_MAX_ASSIGNMENTS):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        ok, reason = triton_decode_available(w13_weight.device)
        if not ok:
            raise RuntimeError(f"Triton MXFP4 decode path unavailable: {reason}")
        E, H, I = _check_weights(w13_weight, w13_weight_scale, w2_weight, w2_weight_scale)
        if mode != "dequant_fma" and act_dtype != torch.bfloat16:
            raise ValueError(f"mode {mode!r} multiplies BF16 activations; act_dtype must be bfloat16")
        for label, block, dim in (("block_i", block_i, I), ("block_h", block_h, H),
                                  ("block_k_gate_up", block_k_gate_up, H),
                                  ("block_k_down", block_k_down, I)):
            if block & (block - 1) or dim % block:
                raise ValueError(f"{label}={block} must be a power of two dividing {dim}")
        if mode != "dequant_fma" and block_i < 16:
            raise ValueError(f"block_i={block_i}: the MMA modes need at least 16 rows per tile")
        if min(block_k_gate_up, block_k_down) < 64:
            raise ValueError("block_k_* must be >= 64 (two E8M0 groups per tile at least)")
        self.num_experts, self.hidden_size, self.intermediate_size = E, H, I
        self.mode = mode
        self.block_i, self.block_h = block_i, block_h
        self.block_k_gate_up, self.block_k_down = block_k_gate_up, block_k_down
        self.num_warps, self.num_stages = num_warps, num_stages
        self.act_dtype = act_dtype
        self.max_assignments = max_assignments
        # Kernels index with compile-time strides: contiguous uint8 views (no copy if already so).
        self.w13 = w13_weight.contiguous().view(torch.uint8)
        self.w13_scale = w13_weight_scale.contiguous().view(torch.uint8)
        self.w2 = w2_weight.contiguous().view(torch.uint8)
        self.w2_scale = w2_weight_scale.contiguous().view(torch.uint8)
        self.device = self.w13.device

    def bytes_per_expert(self) -> int:
        H, I = self.hidden_size, self.intermediate_size
        return 3 * H * I // 2 + 3 * H * I // MXFP4_GROUP

    def forward(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                swiglu_limit: float | None = None) -> torch.Tensor:
        if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != self.hidden_size:
            raise ValueError(f"hidden states must be bfloat16 [T, {self.hidden_size}], "
                             f"got {x.dtype} {tuple(x.shape)}")
        if topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"topk_ids {tuple(topk_ids.shape)} and topk_weights "
                             f"{tuple(topk_weights.shape)} must both be [T={x.shape[0]}, top_k]")
        T, top_k = topk_ids.shape
        if T * top_k > self.max_assignments:
            raise ValueError(f"T * top_k = {T * top_k} exceeds max_assignments={self.max_assignments} "
                             "of the Triton decode path; use the humming path for larger batches")
        limit = None if swiglu_limit is None else float(swiglu_limit)
        if limit is not None and (limit < 0 or limit != limit):
            raise ValueError(f"swiglu_limit must be None, 0 or positive, got {swiglu_limit}")
        has_limit = bool(limit)
        gate_up, down = _get_kernels()
        H, I = self.hidden_size, self.intermediate_size
        mode_id = _MODE_ID[self.mode]
        ids = topk_ids.contiguous()
        weights = topk_weights.contiguous()
        x = x.contiguous()
        act = torch.empty(T * top_k, I, dtype=self.act_dtype, device=x.device)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=x.device)
        gate_up[(T * top_k, I // self.block_i)](
            x, ids, self.w13, self.w13_scale, act, limit if has_limit else 0.0,
            H=H, I=I, TOP_K=top_k, BLOCK_I=self.block_i, BLOCK_K=self.block_k_gate_up,
            MODE=mode_id, HAS_LIMIT=has_limit, N_PAD=_N_PAD,
            num_warps=self.num_warps, num_stages=self.num_stages)
        top_k_pad = triton.next_power_of_2(top_k)
        if mode_id != _MODE_ID["dequant_fma"] and top_k_pad * self.block_h < 16:
            raise ValueError(f"top_k={top_k} x block_h={self.block_h} rows < 16: the MMA modes need "
                             "a larger block_h")
        down[(T, H // self.block_h)](
            act, ids, weights, self.w2, self.w2_scale, out,
            H=H, I=I, TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_H=self.block_h,
            BLOCK_K=self.block_k_down, MODE=mode_id, N_PAD=max(_N_PAD, top_k_pad),
            num_warps=self.num_warps, num_stages=self.num_stages)
        return out

    __call__ = forward
