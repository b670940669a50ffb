"""FP8 e4m3 problems: a dense block-FP8 linear and the per-row-scaled LM head, and the
ops-level head-kernel check."""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from vllm_ling.ops.known_answer.formats import (DENSE_ROW_RTOL, E4M3_TABLE, FINITE_E4M3_CODES, ONE_HOT_RTOL,
                                                code_ranges, pow2_label)
from vllm_ling.ops.known_answer.runner import KernelCheckResult, KnownAnswerCase, run_check


# Block (row, col) -> (content, scale): every finite code at scale 1, an all-zero block at
# scale 1 (the tiny checkpoint's trap), every code at a tiny and at a huge scale.
DENSE_BLOCKS = {(0, 0): ("all", 1.0), (0, 1): ("zero", 1.0),
                (1, 0): ("all", 2.0 ** -24), (1, 1): ("all", 2.0 ** 16)}


@dataclasses.dataclass
class BlockFp8Problem:
    weight: torch.Tensor  # float8_e4m3fn [N, K]
    scale_inv: torch.Tensor  # float32 [N/128, K/128]
    block: tuple[int, int]
    cases: list[KnownAnswerCase]


def _finite_code_grid(rows: int, cols: int, stride: int) -> torch.Tensor:
    idx = (torch.arange(rows)[:, None] * stride + torch.arange(cols)[None, :]) % len(FINITE_E4M3_CODES)
    return torch.tensor(FINITE_E4M3_CODES, dtype=torch.uint8)[idx]


FP8_EXACT_ROW_SCALE = 2.0 ** -8  # the random row's group scale: its largest magnitude is 448 * 2^-8 = 1.75


def fp8_exact_row(k: int, group: int, seed: int = 0) -> torch.Tensor:
    """A random BF16 row [1, k] that FP8 activation quantization leaves unchanged: Gaussian values
    rounded to e4m3 codes times 2^-8, every ``group`` inputs holding +-448 * 2^-8 as their largest
    magnitude. The group scale amax/448 a W8A8 kernel computes is then exactly 2^-8, whether it
    keeps it in fp32 or rounds it up to a power of two (UE8M0), per group or per token, and every
    value is a code: W8A8 and W8A16 kernels owe the same answer, to the same tolerance."""
    g = torch.randn(k // group, group, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    g = (g * (448.0 / g.abs().amax(-1, keepdim=True))).to(torch.float32).to(torch.float8_e4m3fn)
    return (g.to(torch.float64) * FP8_EXACT_ROW_SCALE).reshape(1, k).to(torch.bfloat16)


def block_fp8_linear_problem(block: tuple[int, int] = (128, 128), seed: int = 0) -> BlockFp8Problem:
    """A [2*bn, 2*bk] block-FP8 weight laid out as ``DENSE_BLOCKS`` and two inputs: the
    one-hot rows of the identity (GEMM-sized, 2*bk tokens; output = every weight alone) and
    one random token (decode-sized; accumulation across blocks), :func:`fp8_exact_row` so that
    kernels quantizing activations to FP8 per 128 inputs (vLLM's W8A8 kernels) owe the same
    answer as W8A16 ones: both exact in FP8, the one-hot rows and the random row."""
    bn, bk = block
    n, k = 2 * bn, 2 * bk
    codes = torch.zeros(n, k, dtype=torch.uint8)
    scale = torch.ones(2, 2, dtype=torch.float32)
    for (r, c), (content, s) in DENSE_BLOCKS.items():
        if content == "all":
            codes[r * bn:(r + 1) * bn, c * bk:(c + 1) * bk] = _finite_code_grid(bn, bk, bk)
        scale[r, c] = s
    scale64 = scale.double().repeat_interleave(bn, 0).repeat_interleave(bk, 1)  # [N, K]
    w = E4M3_TABLE[codes.long()] * scale64
    eye = torch.eye(k, dtype=torch.bfloat16)

    def explain_one_hot(bad: torch.Tensor) -> str:  # bad [K tokens, N outputs] -> weight [N, K]
        pos = bad.t()
        blocks = sorted({(int(i) // bn, int(j) // bk) for i, j in pos.nonzero().tolist()})
        names = ", ".join(f"[{r},{c}] x{pow2_label(float(scale[r, c]))}"
                          + (" (all-zero)" if DENSE_BLOCKS.get((r, c), ("",))[0] == "zero" else "")
                          for r, c in blocks)
        return f"wrong e4m3 codes {code_ranges(codes[pos].tolist())} in blocks {names}"

    x1 = fp8_exact_row(k, bk, seed)
    cases = [
        KnownAnswerCase(f"{k} one-hot rows (GEMM-sized)", {"x": eye}, w.t().contiguous(), ONE_HOT_RTOL,
                        floor=scale64.t() * 2.0 ** -12, explain=explain_one_hot),
        KnownAnswerCase("1 random row (decode-sized)", {"x": x1}, x1.double() @ w.t(), DENSE_ROW_RTOL,
                        per_row=True),
    ]
    return BlockFp8Problem(codes.view(torch.float8_e4m3fn), scale, block, cases)


@dataclasses.dataclass
class Fp8HeadProblem:
    weight: torch.Tensor  # float8_e4m3fn [V, H]
    scale: torch.Tensor  # float32 [V]
    cases: list[KnownAnswerCase]


def fp8_head_problem(vocab: int = 256, hidden: int = 256, seed: int = 0) -> Fp8HeadProblem:
    """Every finite code in every row; row scales 2^-20 .. 2^12 with BF16 mantissas. Cases:
    ``hidden`` one-hot rows (GEMM-sized) and 1 random row (decode-sized), :func:`fp8_exact_row`
    with the whole row as its group: its amax is 448 * 2^-8, so the dynamic per-token scale
    amax/448 of a kernel that quantizes activations ("scaled_mm") is exactly 2^-8 and every
    value divides to an e4m3 code. W8A8 and W8A16 head kernels owe the same answer to the same
    tolerance, and the check needs no knowledge of which kernel quantizes."""
    codes = _finite_code_grid(vocab, hidden, 7)
    v = torch.arange(vocab, dtype=torch.float64)
    scale = ((1 + (v % 8) / 8) * torch.pow(2.0, v % 33 - 20)).float()  # exact in BF16
    w = E4M3_TABLE[codes.long()] * scale.double()[:, None]
    eye = torch.eye(hidden, dtype=torch.bfloat16)

    def explain_one_hot(bad: torch.Tensor) -> str:  # bad [H tokens, V] -> weight [V, H]
        pos = bad.t()
        rows = pos.any(dim=1).nonzero().flatten()
        return (f"wrong e4m3 codes {code_ranges(codes[pos].tolist())} in {len(rows)} rows "
                f"(scales {pow2_label(float(scale[rows].min()))}..{pow2_label(float(scale[rows].max()))})")

    x1 = fp8_exact_row(hidden, hidden, seed)
    cases = [
        KnownAnswerCase(f"{hidden} one-hot rows (GEMM-sized)", {"x": eye}, w.t().contiguous(), ONE_HOT_RTOL,
                        floor=scale.double()[None, :] * 2.0 ** -12, explain=explain_one_hot),
        KnownAnswerCase("1 random row (decode-sized)", {"x": x1}, x1.double() @ w.t(), DENSE_ROW_RTOL, per_row=True),
    ]
    return Fp8HeadProblem(codes.view(torch.float8_e4m3fn), scale, cases)


def check_fp8_head_kernel(kernel: str, device: torch.device | str,
                          plant: Callable[[torch.Tensor, torch.Tensor], tuple] | None = None) -> KernelCheckResult:
    """Prepare ``kernel``'s FP8 head state from :func:`fp8_head_problem` (``plant(weight,
    scale) -> (weight, scale)`` corrupts what it is given) and check its logits."""
    from vllm_ling.ops import lm_head

    problem = fp8_head_problem()
    weight, scale = (problem.weight, problem.scale) if plant is None else plant(problem.weight, problem.scale)
    state = lm_head.prepare_fp8_head(weight.to(device), scale.to(device), kernel)
    return run_check("fp8_head", kernel, problem.cases,
                     lambda inp: lm_head.fp8_head_logits(inp["x"].to(device), state))
