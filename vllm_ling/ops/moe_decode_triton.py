"""Triton MXFP4 fused-MoE decode path for small batches (T * top_k <= 32 assignments).

Status: an experiment for issue 3's speed target, NOT used by the serving path. Measured
on the H200 it ties humming at 1 token (29.1 vs 30.1 us per layer) and loses at 4 tokens
(76.3 vs 60.9 us): it is bound by the integer decode work per weight, not by memory
(benchmarks/results/moe_decode_triton_h200.md). Kept with its tests so the next lever
(two weights per integer instruction) starts from measured ground.

Why: at 1-4 tokens a Ling MoE layer is a set of GEMVs (8 experts x 3 matrices per token);
humming's indexed GEMM spends ~30 us per layer at 1 token on 25 MB (0.20 of the copy
bandwidth, see benchmarks/results/moe_stacked_h200.md). Two launches here, each spread
over every SM even at 1 token:

1. gate_up + SwiGLU: grid (assignment, I / BLOCK_I). One program reads BLOCK_I gate rows
   and the matching BLOCK_I up rows of expert ``topk_ids.flat[a]``, multiplies them with
   x[token], applies SwiGLU with vLLM's routed-expert clamp
   ``silu(min(g, L)) * clamp(u, -L, L)`` and writes act [T*top_k, I] (BF16).
2. down + weighted sum: grid (token, H / BLOCK_H). One program takes BLOCK_H rows of w2
   from *each* of the token's top-k experts as one tile (top_k * BLOCK_H rows, all loads
   in flight together), multiplies them with the matching act rows, scales by the top-k
   weights and sums in registers (no atomics, no zero-fill, deterministic), then writes
   out [T, H] in BF16.

Input layout is vLLM's MXFP4 MoE layout: ``w13_weight`` uint8 [E, 2I, H/2] (gate rows then
up rows; element 2i in the low nibble), ``w13_weight_scale`` uint8 E8M0 [E, 2I, H/32],
``w2_weight`` uint8 [E, H, I/2], ``w2_weight_scale`` uint8 [E, H, I/32].

Dequantisation ``mode`` (measured on the H200: benchmarks/results/moe_decode_triton_h200.md):
- ``"words_fma"`` (default, fastest): the codes are repacked ONCE at construction into
  int32 words (:func:`repack_mxfp4_words`: same bytes, a new copy; scales unchanged) so that
  one word holds the 8 codes that share the activation offsets 4t + q of a 32-group. Each
  code becomes an fp32 bit pattern worth ``v * 2**-126`` in two shifts and a mask-or (no
  lookup table, no int->float conversion; e = 0 codes are fp32 subnormals, which Triton's
  plain fp32 multiply keeps -- the GPU tests would fail by O(1) otherwise); activations
  are pre-multiplied by 2**90 so the products stay normal, and the group scale times
  2**(126-90) is applied once per 32 elements. One fp32 FMA per weight.
  Needs E8M0 exponents <= 218 (checked at construction).
- ``"dot_scaled"``: ``tl.dot_scaled`` (e2m1 weights x BF16 activations, E8M0 scales), vLLM
  layout as is; the vector is padded to an MMA of 16 columns. 2.8x slower than words_fma
  at 1 token on the H200 with Triton 3.6 (its e2m1 upcast dominates).
- ``"dequant_dot"`` / ``"dequant_fma"``: a generic e2m1 -> fp32 decode (bit pattern for
  codes >= 2, 0 / 0.5 otherwise; exact) fed to ``tl.dot`` (BF16, exact) or to fp32 FMAs;
  vLLM layout as is; slower (kept as independent checks of the decode).

No host synchronisation and no data-dependent shapes in ``forward``: it is CUDA-graph
capturable (tested). The dequant modes decode E8M0 exponent 0 (2**-127) as 0 and 255 (NaN)
as +inf; real checkpoints use neither. No vLLM import; Triton is imported guarded (the
module imports without it and :func:`triton_decode_available` says why).
"""

from __future__ import annotations

import os

import torch

MXFP4_GROUP = 32
MODES = ("words_fma", "dot_scaled", "dequant_dot", "dequant_fma")
_MODE_ID = {"dot_scaled": 0, "dequant_dot": 1, "dequant_fma": 2}
# words_fma: activations are multiplied by 2**X_PRESCALE_EXP so that products with the
# (v * 2**-126)-valued decoded weights stay normal; the group scale 2**(s-127) and the
# remaining 2**(126 - X_PRESCALE_EXP) are applied once per 32-element group.
X_PRESCALE_EXP = 90
# group factor 2**(s - 127 + 126 - X_PRESCALE_EXP) = 2**(s - 91) has biased exponent s + 36,
# a finite fp32 for s <= 218 (weights up to 6 * 2**91; real checkpoints are near s = 127)
WORDS_MAX_SCALE_EXP = 218
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


    # ---- words_fma: weights repacked once into uint32 words (see repack_mxfp4_words) ----
    @triton.jit
    def _words_times_x(words, x_ptrs, x_mask, X_SCALE: tl.constexpr):
        """sum_t decode(words, slot t) * x[4t + q] (* 2**X_PRESCALE_EXP) over the 8 slots.

        words uint32 [..., G, 4]; x_ptrs points at element 4*0 + q of each group. A slot's
        e2m1 code (s e1 e0 m at bits 4t..4t+3) becomes an fp32 bit pattern with m at bit 22,
        e at 23-24 and s at 31: the value v * 2**-126 exactly (a subnormal for e = 0), in
        two shifts and one mask-or -- the whole decode, no table, no int->float convert.
        """
        part = tl.zeros(words.shape, dtype=tl.float32)
        for t in tl.static_range(8):
            if 4 * t <= 22:
                mag = (words << (22 - 4 * t)) & 0x01C00000
            else:
                mag = (words >> (4 * t - 22)) & 0x01C00000
            sign = (words << (28 - 4 * t)) & 0x80000000
            val = (mag | sign).to(tl.float32, bitcast=True)
            if x_mask is None:
                xv = tl.load(x_ptrs + 4 * t)
            else:
                xv = tl.load(x_ptrs + 4 * t, mask=x_mask, other=0.0)
            xv = xv.to(tl.float32) * X_SCALE
            part += val * xv
        return part

    @triton.jit
    def _group_scale(s_u8):
        # 2**(s - 127) * 2**(126 - X_PRESCALE_EXP) with X_PRESCALE_EXP = 90 -> 2**(s - 91)
        return ((s_u8.to(tl.int32) + 36) << 23).to(tl.float32, bitcast=True)

    @triton.jit
    def _gate_up_swiglu_words(x_ptr, ids_ptr, w_ptr, s_ptr, act_ptr, limit,
                              H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                              BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr,
                              HAS_LIMIT: tl.constexpr, X_SCALE: tl.constexpr):
        a = tl.program_id(0)
        pid_i = tl.program_id(1)
        tok = a // TOP_K
        e = tl.load(ids_ptr + a).to(tl.int64)
        G: tl.constexpr = BLOCK_K // 32
        rows = pid_i * BLOCK_I + tl.arange(0, BLOCK_I)
        gi = tl.arange(0, G)
        qi = tl.arange(0, 4)
        # words: [E, 2I, H/8]; (row, group g, word q) -> row * H/8 + g * 4 + q
        w_gate = (w_ptr + e * (2 * I * (H // 8)) + rows[:, None, None] * (H // 8)
                  + gi[None, :, None] * 4 + qi[None, None, :])
        s_gate = s_ptr + e * (2 * I * (H // 32)) + rows[:, None] * (H // 32) + gi[None, :]
        w_up = w_gate + I * (H // 8)
        s_up = s_gate + I * (H // 32)
        x_ptrs = x_ptr + tok.to(tl.int64) * H + gi[:, None] * 32 + qi[None, :]  # [G, 4]
        acc_g = tl.zeros((BLOCK_I, G), dtype=tl.float32)
        acc_u = tl.zeros((BLOCK_I, G), dtype=tl.float32)
        for k0 in range(0, H, BLOCK_K):
            wg = tl.load(w_gate + k0 // 8).to(tl.uint32, bitcast=True)
            wu = tl.load(w_up + k0 // 8).to(tl.uint32, bitcast=True)
            sg = _group_scale(tl.load(s_gate + k0 // 32))
            su = _group_scale(tl.load(s_up + k0 // 32))
            acc_g += tl.sum(_words_times_x(wg, x_ptrs[None, :, :] + k0, None, X_SCALE), axis=2) * sg
            acc_u += tl.sum(_words_times_x(wu, x_ptrs[None, :, :] + k0, None, X_SCALE), axis=2) * su
        g = tl.sum(acc_g, axis=1)
        u = tl.sum(acc_u, axis=1)
        if HAS_LIMIT:
            g = tl.minimum(g, limit)
            u = tl.minimum(tl.maximum(u, -limit), limit)
        act = g / (1.0 + tl.exp(-g)) * u
        tl.store(act_ptr + a.to(tl.int64) * I + rows, act.to(act_ptr.dtype.element_ty))

    @triton.jit
    def _down_weighted_sum_words(act_ptr, ids_ptr, topk_w_ptr, w_ptr, s_ptr, out_ptr,
                                 H: tl.constexpr, I: tl.constexpr, TOP_K: tl.constexpr,
                                 TOP_K_PAD: tl.constexpr, BLOCK_H: tl.constexpr,
                                 BLOCK_K: tl.constexpr, X_SCALE: tl.constexpr):
        tok = tl.program_id(0)
        pid_h = tl.program_id(1)
        ROWS: tl.constexpr = TOP_K_PAD * BLOCK_H
        G: tl.constexpr = BLOCK_K // 32
        r = tl.arange(0, ROWS)
        slot = r // BLOCK_H
        h = pid_h * BLOCK_H + r % BLOCK_H
        valid = slot < TOP_K
        a_row = tok * TOP_K + slot
        e = tl.load(ids_ptr + a_row, mask=valid, other=0).to(tl.int64)
        gi = tl.arange(0, G)
        qi = tl.arange(0, 4)
        w_ptrs = (w_ptr + e[:, None, None] * (H * (I // 8)) + h[:, None, None] * (I // 8)
                  + gi[None, :, None] * 4 + qi[None, None, :])
        s_ptrs = s_ptr + e[:, None] * (H * (I // 32)) + h[:, None] * (I // 32) + gi[None, :]
        v_ptrs = (act_ptr + a_row[:, None, None].to(tl.int64) * I + gi[None, :, None] * 32
                  + qi[None, None, :])
        mask3 = valid[:, None, None]
        acc = tl.zeros((ROWS, G), dtype=tl.float32)
        for k0 in range(0, I, BLOCK_K):
            words = tl.load(w_ptrs + k0 // 8, mask=mask3, other=0).to(tl.uint32, bitcast=True)
            sc = _group_scale(tl.load(s_ptrs + k0 // 32, mask=valid[:, None], other=0))
            acc += tl.sum(_words_times_x(words, v_ptrs + k0, mask3, X_SCALE), axis=2) * sc
        weight = tl.load(topk_w_ptr + a_row, mask=valid, other=0.0).to(tl.float32)
        y_rows = tl.sum(acc, axis=1) * weight
        y = tl.sum(tl.reshape(y_rows, (TOP_K_PAD, BLOCK_H)), axis=0)
        out_rows = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
        tl.store(out_ptr + tok.to(tl.int64) * H + out_rows, y.to(out_ptr.dtype.element_ty))


def repack_mxfp4_words(packed: torch.Tensor, experts_per_chunk: int = 16) -> torch.Tensor:
    """vLLM MXFP4 codes uint8 [E, N, K/2] -> int32 words [E, N, K/8] for ``words_fma``.

    Per 32-element group g (16 bytes in, 4 words out): word q holds in bits 4t..4t+3 the
    code of element 32g + 4t + q (t = 0..7), so the 4 words of a group share the x offsets
    4t + q (contiguous in q for every slot t). Same bytes as the input; done once.
    """
    E, N, half_k = packed.shape
    K = 2 * half_k
    if K % MXFP4_GROUP:
        raise ValueError(f"K={K} must be a multiple of {MXFP4_GROUP}")
    out = torch.empty(E, N, K // 8, dtype=torch.int32, device=packed.device)
    shifts = (4 * torch.arange(8, device=packed.device, dtype=torch.int64)).view(8, 1)
    for e0 in range(0, E, experts_per_chunk):
        p = packed[e0:e0 + experts_per_chunk].view(torch.uint8)
        codes = torch.stack((p & 0xF, p >> 4), dim=-1).reshape(p.shape[0], N, K // 32, 8, 4)
        words = (codes.to(torch.int64) << shifts).sum(dim=-2)  # [e, N, K/32, 4]
        words = (words + 2 ** 31) % 2 ** 32 - 2 ** 31  # two's complement int32
        out[e0:e0 + experts_per_chunk] = words.reshape(p.shape[0], N, K // 8).to(torch.int32)
    return out


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
                 mode: str = "words_fma", block_i: int = 16, block_h: int = 8,
                 block_k_gate_up: int = 512, block_k_down: int = 256,
                 num_warps: int = 4, num_stages: int = 3,
                 act_dtype: torch.dtype = torch.bfloat16,
                 max_assignments: int = DEFAULT_MAX_ASSIGNMENTS):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        ok, reason = triton_decode_available(w13_weight.device)
        if not ok:
            raise RuntimeError(f"Triton MXFP4 decode path unavailable: {reason}")
        E, H, I = _check_weights(w13_weight, w13_weight_scale, w2_weight, w2_weight_scale)
        if mode in ("dot_scaled", "dequant_dot") and act_dtype != torch.bfloat16:
            raise ValueError(f"mode {mode!r} multiplies BF16 activations; act_dtype must be bfloat16")
        for label, block, dim in (("block_i", block_i, I), ("block_h", block_h, H),
                                  ("block_k_gate_up", block_k_gate_up, H),
                                  ("block_k_down", block_k_down, I)):
            if block & (block - 1) or dim % block:
                raise ValueError(f"{label}={block} must be a power of two dividing {dim}")
        if mode in ("dot_scaled", "dequant_dot") and block_i < 16:
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
        self.w13_scale = w13_weight_scale.contiguous().view(torch.uint8)
        self.w2_scale = w2_weight_scale.contiguous().view(torch.uint8)
        if mode == "words_fma":
            # one-time host sync at construction (never inside a captured forward)
            top = max(int(self.w13_scale.max()), int(self.w2_scale.max()))
            if top > WORDS_MAX_SCALE_EXP:
                raise ValueError(f"E8M0 scale exponent {top} > {WORDS_MAX_SCALE_EXP} is outside the "
                                 "range of mode 'words_fma'; use mode 'dot_scaled'")
            # a new copy in the word layout (the caller may free the vLLM-layout tensors)
            self.w13 = repack_mxfp4_words(w13_weight.contiguous().view(torch.uint8))
            self.w2 = repack_mxfp4_words(w2_weight.contiguous().view(torch.uint8))
        else:
            self.w13 = w13_weight.contiguous().view(torch.uint8)
            self.w2 = w2_weight.contiguous().view(torch.uint8)
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
        top_k_pad = triton.next_power_of_2(top_k)
        if self.mode in ("dot_scaled", "dequant_dot") and top_k_pad * self.block_h < 16:
            raise ValueError(f"top_k={top_k} x block_h={self.block_h} rows < 16: the MMA modes need "
                             "a larger block_h")
        ids = topk_ids.contiguous()
        act = self.gate_up(x.contiguous(), ids, limit)
        return self.down(act, topk_weights.contiguous(), ids)

    # The two launches, public so benchmarks can time them alone (inputs already checked).
    def gate_up(self, x: torch.Tensor, topk_ids: torch.Tensor, limit: float | None) -> torch.Tensor:
        """act [T * top_k, I] = SwiGLU(x[token] @ w13[expert].T) per assignment."""
        kernel, _ = _get_kernels()
        T, top_k = topk_ids.shape
        I = self.intermediate_size
        act = torch.empty(T * top_k, I, dtype=self.act_dtype, device=x.device)
        if self.mode == "words_fma":
            _gate_up_swiglu_words[(T * top_k, I // self.block_i)](
                x, topk_ids, self.w13, self.w13_scale, act, limit or 0.0,
                H=self.hidden_size, I=I, TOP_K=top_k, BLOCK_I=self.block_i,
                BLOCK_K=self.block_k_gate_up, HAS_LIMIT=bool(limit), X_SCALE=2.0 ** X_PRESCALE_EXP,
                num_warps=self.num_warps, num_stages=self.num_stages)
            return act
        kernel[(T * top_k, I // self.block_i)](
            x, topk_ids, self.w13, self.w13_scale, act, limit or 0.0,
            H=self.hidden_size, I=I, TOP_K=top_k, BLOCK_I=self.block_i,
            BLOCK_K=self.block_k_gate_up, MODE=_MODE_ID[self.mode], HAS_LIMIT=bool(limit),
            N_PAD=_N_PAD, num_warps=self.num_warps, num_stages=self.num_stages)
        return act

    def down(self, act: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        """out [T, H] (BF16) = sum_k topk_weights[t, k] * act[t*top_k + k] @ w2[expert].T."""
        _, kernel = _get_kernels()
        T, top_k = topk_ids.shape
        H = self.hidden_size
        top_k_pad = triton.next_power_of_2(top_k)
        out = torch.empty(T, H, dtype=torch.bfloat16, device=act.device)
        if self.mode == "words_fma":
            _down_weighted_sum_words[(T, H // self.block_h)](
                act, topk_ids, topk_weights, self.w2, self.w2_scale, out,
                H=H, I=self.intermediate_size, TOP_K=top_k, TOP_K_PAD=top_k_pad,
                BLOCK_H=self.block_h, BLOCK_K=self.block_k_down, X_SCALE=2.0 ** X_PRESCALE_EXP,
                num_warps=self.num_warps, num_stages=self.num_stages)
            return out
        kernel[(T, H // self.block_h)](
            act, topk_ids, topk_weights, self.w2, self.w2_scale, out,
            H=H, I=self.intermediate_size, TOP_K=top_k, TOP_K_PAD=top_k_pad, BLOCK_H=self.block_h,
            BLOCK_K=self.block_k_down, MODE=_MODE_ID[self.mode], N_PAD=max(_N_PAD, top_k_pad),
            num_warps=self.num_warps, num_stages=self.num_stages)
        return out

    __call__ = forward
