"""The ``"triton"`` kernel: one row as an fp32 elementwise GEMV, more rows on the tensor cores
with the e4m3 weight converted to bf16 in registers; fp32 accumulation; the per-row fp32
scale applied once per output. Triton is imported here when installed (the CUDA builds of
torch and vLLM ship it)."""

from __future__ import annotations

import dataclasses

import torch

from vllm_ling.ops.lm_head.state import Fp8HeadState

try:  # Triton ships with CUDA builds of torch and with vLLM; the kernel is optional
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - exercised only where Triton is absent
    triton = None
    tl = None


def triton_available() -> bool:
    return triton is not None


# One program computes logits[m0:m0+BLOCK_M, n0:n0+BLOCK_N] over the whole hidden dim: the
# weight tile is read once, converted e4m3 -> bf16 in registers and multiplied on the tensor
# cores (USE_DOT, BLOCK_M >= 16), or, for a single row, multiplied elementwise in fp32 and
# reduced (no tensor cores, no padding rows). The per-row scale is applied once at the end.
if triton is not None:

    @triton.jit
    def _fp8_head_kernel(
        x_ptr, w_ptr, scale_ptr, out_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_om,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        USE_DOT: tl.constexpr, EVEN_K: tl.constexpr, DOT_FP16: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_k = tl.arange(0, BLOCK_K)
        mask_n = offs_n < N
        mask_m = offs_m < M
        # Out-of-range rows re-read row 0 instead of predicating every weight load.
        rows_n = tl.where(mask_n, offs_n, 0).to(tl.int64)
        rows_m = tl.where(mask_m, offs_m, 0)
        w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
        if USE_DOT:
            x_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
        else:
            x_ptrs = x_ptr + rows_m[:, None] * stride_xm + offs_k[None, :]
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:
                w = tl.load(w_ptrs)
                x = tl.load(x_ptrs)
            else:
                k_ok = (k0 + offs_k) < K
                w = tl.load(w_ptrs, mask=k_ok[None, :], other=0.0)
                if USE_DOT:
                    x = tl.load(x_ptrs, mask=k_ok[:, None], other=0.0)
                else:
                    x = tl.load(x_ptrs, mask=k_ok[None, :], other=0.0)
            if USE_DOT and DOT_FP16:
                # e4m3 -> fp16 is one packed conversion (bf16 needs two) and exact; x in fp16 is
                # exact for bf16 values of magnitude 6e-5..65504 (see TritonHeadConfig).
                acc = tl.dot(w.to(tl.float16), x.to(tl.float16), acc)
            elif USE_DOT:
                acc = tl.dot(w.to(tl.bfloat16), x.to(tl.bfloat16), acc)
            else:
                acc += tl.sum(w.to(tl.float32) * x.to(tl.float32), axis=1)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
        if USE_DOT:
            res = acc * scale[:, None]
            out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
            tl.store(out_ptrs, res.to(out_ptr.dtype.element_ty), mask=mask_n[:, None] & mask_m[None, :])
        else:
            res = acc * scale
            tl.store(out_ptr + offs_m * stride_om + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask_n)

else:
    _fp8_head_kernel = None


@dataclasses.dataclass(frozen=True)
class TritonHeadConfig:
    block_m: int
    block_n: int
    block_k: int
    use_dot: bool
    num_warps: int
    num_stages: int
    # fp16 tensor-core inputs: faster conversion, but hidden values must stay below 65504
    # in magnitude (true after the final RMSNorm unless its weights exceed ~1000).
    dot_fp16: bool = False


# Per row-count bucket (upper bound of M, config). 1 and 2..16 rows: best of the H200 sweeps
# (benchmarks/results/lm_head_h200.md): one row elementwise fp32, 2..16 rows bf16 tensor cores;
# fp16 tensor-core inputs are faster at 16 rows but overflow for |hidden| > 65504, so they stay
# off by default. Buckets above 16 rows were not tuned (larger batches are correct, just not
# tuned).
TRITON_CONFIGS: tuple[tuple[int, TritonHeadConfig], ...] = (
    (1, TritonHeadConfig(1, 16, 512, False, 2, 3)),
    (16, TritonHeadConfig(16, 64, 128, True, 4, 4)),
    (32, TritonHeadConfig(32, 64, 128, True, 4, 4)),
    (64, TritonHeadConfig(64, 128, 64, True, 4, 4)),
    (1 << 62, TritonHeadConfig(128, 128, 64, True, 8, 4)),
)


def triton_config_for(rows: int) -> TritonHeadConfig:
    for bound, config in TRITON_CONFIGS:
        if rows <= bound:
            return config
    return TRITON_CONFIGS[-1][1]


def triton_logits(x: torch.Tensor, state: Fp8HeadState, out: torch.Tensor | None,
                   config: TritonHeadConfig | None = None) -> torch.Tensor:
    kernel = _fp8_head_kernel
    x = x.to(torch.bfloat16).contiguous()
    rows = x.shape[0]
    config = config or triton_config_for(rows)
    if not config.use_dot and config.block_m != 1:
        raise ValueError("the elementwise Triton path handles one row per program (block_m=1)")
    if out is None:
        out = torch.empty((rows, state.vocab_size), dtype=state.out_dtype, device=x.device)
    elif out.shape != (rows, state.vocab_size) or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous [{rows}, {state.vocab_size}] tensor")
    grid = (-(-state.vocab_size // config.block_n), -(-rows // config.block_m))
    kernel[grid](
        x, state.weight, state.scale, out,
        rows, state.vocab_size, state.hidden_size,
        x.stride(0), state.weight.stride(0), out.stride(0),
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        USE_DOT=config.use_dot, EVEN_K=state.hidden_size % config.block_k == 0, DOT_FP16=config.dot_fp16,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    return out
