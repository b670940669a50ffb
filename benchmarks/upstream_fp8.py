"""Runnable stand-ins for the block-FP8 linear vLLM 0.32 selects on sm_90 (benchmarks only).

vLLM 0.32 (``model_executor/kernels/linear/__init__.py``, ``_POSSIBLE_FP8_BLOCK_KERNELS``) tries,
in order, FlashInfer's DeepGEMM wrapper, DeepGEMM ``fp8_gemm_nt``, CUTLASS block-scaled,
..., Triton ``w8a8_block_fp8_matmul``; on an H200 with vLLM's vendored DeepGEMM it runs DeepGEMM
(every Ling shape has N % 64 == 0 and K % 128 == 0): W8A8, activations quantized per token
and 128-wide group by a separate kernel, then a block-scaled FP8 tensor-core GEMM. The device
has no vLLM, so the same recipe is composed from what is there:

- ``scaled_mm``: our per-token-group quant (one Triton kernel) + cuBLASLt's block-scaled FP8
  GEMM through ``torch.nn.functional.scaled_mm`` (1x128 activation / 128x128 weight scales):
  a library W8A8 block-scaled kernel like DeepGEMM and CUTLASS, two launches like vLLM's path;
- ``triton_w8a8``: the same quant + a Triton W8A8 block-scaled GEMM written here in the
  style of vLLM's Triton fallback (fp8 x fp8 dot per 128-k step, scaled by a_s * b_s).

No vLLM import, no vLLM code copied.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0


@triton.jit
def _group_quant_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sk, GROUP: tl.constexpr):
    # one program per (row, 128-group); rows >= M (padding) get zeros and scale 1
    row = tl.program_id(0)
    g = tl.program_id(1)
    offs = g * GROUP + tl.arange(0, GROUP)
    x = tl.load(x_ptr + row * stride_xm + offs, mask=(row < M) & (offs < K), other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = tl.where(amax > 0, tl.maximum(amax, 1e-10) / 448.0, 1.0)
    q = tl.clamp(x / scale, -448.0, 448.0)
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=offs < K)
    tl.store(s_ptr + g * stride_sk + row, scale)  # column-major [M_pad, K/128]


def group_quant(x: torch.Tensor, m_pad: int) -> tuple[torch.Tensor, torch.Tensor]:
    """BF16 [M, K] -> (e4m3 [m_pad, K], fp32 scales [m_pad, K/128] stored column-major)."""
    m, k = x.shape
    q = torch.empty((m_pad, k), dtype=FP8, device=x.device)
    s_t = torch.empty((k // 128, m_pad), dtype=torch.float32, device=x.device)
    _group_quant_kernel[(m_pad, k // 128)](x, q, s_t, m, k, x.stride(0), q.stride(0), s_t.stride(0), GROUP=128)
    return q, s_t.t()


class ScaledMmBlockFp8:
    """DeepGEMM-equivalent W8A8: group quant + cuBLASLt block-scaled FP8 GEMM."""

    name = "W8A8 group-quant + cuBLASLt block-scaled FP8 (torch scaled_mm; stands in for DeepGEMM)"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        import torch.nn.functional as F

        self.F = F
        self.w = weight
        kb = scale.shape[1]
        # cuBLASLt wants the weight scales' K blocks padded to a multiple of 4.
        self.s_t = torch.nn.functional.pad(scale, (0, -kb % 4)).t() if kb % 4 else scale.t()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        m_pad = -(-m // 4) * 4
        q, s = group_quant(x, m_pad)
        F = self.F
        out = F.scaled_mm(q, self.w.t(), s, F.ScalingType.BlockWise1x128, self.s_t,
                          F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16)
        return out[:m]


@triton.jit
def _w8a8_block_kernel(a_ptr, as_ptr, w_ptr, ws_ptr, out_ptr, M, N, K,
                       stride_am, stride_ask, stride_wn, stride_wsn, stride_om,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    QB: tl.constexpr = 128
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, QB)
    mask_m = offs_m < M
    mask_n = offs_n < N
    a_ptrs = a_ptr + offs_m[:, None] * stride_am + offs_k[None, :]
    w_ptrs = w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(0, K // QB):
        a = tl.load(a_ptrs + kb * QB, mask=mask_m[:, None], other=0.0)
        w = tl.load(w_ptrs + kb * QB, mask=mask_n[None, :], other=0.0)
        a_s = tl.load(as_ptr + kb * stride_ask + offs_m, mask=mask_m, other=0.0)
        w_s = tl.load(ws_ptr + (offs_n // QB) * stride_wsn + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, w) * a_s[:, None] * w_s[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None] & mask_n[None, :])


class TritonW8A8BlockFp8:
    """vLLM's Triton fallback recipe: group quant + Triton W8A8 block-scaled GEMM."""

    name = "W8A8 group-quant + Triton block-scaled FP8 GEMM (vLLM's Triton fallback recipe)"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor, block_n: int = 64):
        self.w, self.s, self.block_n = weight, scale, block_n

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = self.w.shape[0]
        block_m = 16 if m <= 16 else 32 if m <= 32 else 64
        q, s = group_quant(x, m)
        out = torch.empty((m, n), dtype=torch.bfloat16, device=x.device)
        grid = (-(-n // self.block_n), -(-m // block_m))
        _w8a8_block_kernel[grid](q, s, self.w, self.s, out, m, n, k, q.stride(0), s.stride(1),
                                 self.w.stride(0), self.s.stride(0), out.stride(0),
                                 BLOCK_M=block_m, BLOCK_N=self.block_n, num_warps=4, num_stages=4)
        return out
