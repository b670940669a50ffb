"""Every FP8 LM-head kernel against the fp32 reference at the Ling head's shape (GPU only).

Head: 157,184 x 2,560 BF16 with trained-head-like structure (log-normal row norms, 8 outlier
channels, three zero padding rows at the end), quantized with ``quantize_fp8_per_channel``.
Hidden states: half confident (pushed towards one token), half uncertain. Row counts 1, 3, 4,
16 and 17 (odd counts and one past a Triton bucket).

Tolerances, per logit, with ``S = |x| @ |w_deq|.T`` (the sum of the magnitudes of the terms):
- Triton vs fp32 logits of the *same* dequantized weights (bit-identical weights; BF16
  activations, fp32 accumulation, one BF16 rounding of the output):
  ``2**-8 * |ref| + 2**-12 * S``: half a BF16 step of the output, plus the worst case of fp32
  accumulation over 2,560 terms (2560 * 2**-24 = 2**-12.7).
- humming, same comparison: ``2**-7 * |ref| + 2**-9 * S``. Measured on the H200, humming's
  output is up to one BF16 step off (it rounds before and after the per-channel scale), and
  its error grows with S (consistent with 16-bit K-split partial sums: max 8.3e-4 * S seen), so the
  tolerance is one BF16 step plus 2.4x the worst seen partial-sum error.
- ``torch._scaled_mm`` also quantizes activations per token to e4m3 (error per element at most
  2**-4 of it, plus 2**-10 of its scale for subnormal codes): add ``2**-4 * S`` and
  ``2**-10 * scale_x * sum|w_deq|``.
- Argmax must equal the reference's wherever the reference top-1/top-2 margin exceeds the
  two entries' tolerances added.
- Against fp32 logits of the original BF16 weights: the CPU suite's worst-case quantization
  bound (``2**-4 * |x| @ |w|.T`` plus the subnormal term) plus the kernel tolerance above.
"""

from __future__ import annotations

import pytest
import torch

from vllm_ling.ops.lm_head.head import fp8_head_logits, prepare_fp8_head
from vllm_ling.ops.lm_head.humming import HUMMING_TUNING_BY_ARCH
from vllm_ling.ops.lm_head.quantize import quantize_fp8_per_channel, quantize_fp8_per_token
from vllm_ling.ops.lm_head.reference import fp8_reference_logits, reference_logits
from vllm_ling.ops.lm_head.selection import (HEAD_KERNEL_BY_ARCH, KERNEL_ENV, kernel_unavailable_reason,
                                            select_head_kernel)
from vllm_ling.ops.lm_head.state import Fp8HeadState
from vllm_ling.ops.lm_head.warmup import warmup_kernels

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

V, H = 157184, 2560
ROWS = (1, 3, 4, 16, 17)
PAD_ROWS = (V - 3, V - 2, V - 1)
DEV = torch.device("cuda")
FAST_KERNELS = ("humming", "triton", "scaled_mm")


@pytest.fixture(scope="module", autouse=True)
def _true_fp32():
    torch.backends.cuda.matmul.allow_tf32 = False
    yield


@pytest.fixture(scope="module")
def head():
    g = torch.Generator(device=DEV).manual_seed(0)
    w = torch.randn((V, H), device=DEV, generator=g) * 0.02
    w *= torch.exp(0.3 * torch.randn((V, 1), device=DEV, generator=g))
    w[:, torch.randperm(H, device=DEV, generator=g)[:8]] *= 8.0
    w[list(PAD_ROWS)] = 0.0
    w = w.to(torch.bfloat16)
    q, s = quantize_fp8_per_channel(w)
    rows = max(ROWS)
    targets = torch.randint(0, V - 3, (rows,), device=DEV, generator=g)
    push = torch.cat([torch.full((rows - rows // 2,), 12.0, device=DEV),
                      4.0 * torch.rand(rows // 2, device=DEV, generator=g)])
    direction = w[targets].float()
    direction /= direction.norm(dim=1, keepdim=True)
    x = (torch.randn((rows, H), device=DEV, generator=g) + push[:, None] * direction * 8.0).to(torch.bfloat16)
    ref8 = fp8_reference_logits(x, q, s)
    # |x| @ |w_deq|.T: |q| is again an e4m3 value and the scales are positive.
    s_deq = fp8_reference_logits(x.float().abs(), q.float().abs().to(torch.float8_e4m3fn), s)
    ref32 = reference_logits(x, w)
    quant_bound = (2.0**-4 * reference_logits(x.float().abs(), w.float().abs()) * (1 + 1e-5)
                   + 2.0**-10 * s[None, :] * x.float().abs().sum(dim=1, keepdim=True))
    return dict(w=w, q=q, s=s, x=x, ref8=ref8, s_deq=s_deq, ref32=ref32, quant_bound=quant_bound,
                targets=targets)


_states: dict[str, Fp8HeadState] = {}


def state_for(kernel, head) -> Fp8HeadState:
    why_not = kernel_unavailable_reason(kernel, DEV)
    if why_not:
        pytest.skip(f"{kernel} cannot run here: {why_not}")
    if kernel not in _states:
        _states[kernel] = prepare_fp8_head(head["q"], head["s"], kernel)
    return _states[kernel]


def kernel_tolerance(kernel, head, x, rows) -> torch.Tensor:
    ref8, S = head["ref8"][:rows], head["s_deq"][:rows]
    if kernel == "humming":
        # humming rounds to BF16 twice (accumulator, then after the per-channel scale: up to one
        # BF16 step, 2**-7) and its K-split partial sums pass through 16-bit storage (measured
        # at most 8.3e-4 * S on random vectors; 2**-9 = 1.95e-3 leaves a 2.4x margin).
        return 2.0**-7 * ref8.abs() + 2.0**-9 * S
    tol = 2.0**-8 * ref8.abs() + 2.0**-12 * S
    if kernel == "scaled_mm":
        _, sx = quantize_fp8_per_token(x)
        w_abs_sum = head["q"].float().abs().sum(dim=1) * head["s"]
        tol = tol + 2.0**-4 * S + 2.0**-10 * sx * w_abs_sum[None, :]
    return tol


@pytest.mark.parametrize("kernel", FAST_KERNELS)
@pytest.mark.parametrize("rows", ROWS)
def test_kernel_matches_fp32_reference(kernel, rows, head):
    state = state_for(kernel, head)
    x = head["x"][:rows]
    got = fp8_head_logits(x, state)
    torch.cuda.synchronize()
    assert got.shape == (rows, V) and got.dtype == torch.bfloat16
    got = got.float()
    assert torch.isfinite(got).all()
    ref8 = head["ref8"][:rows]
    tol = kernel_tolerance(kernel, head, x, rows)
    err = (got - ref8).abs()
    assert torch.equal(got[:, list(PAD_ROWS)], torch.zeros(rows, 3, device=DEV)), "padding rows must be 0"
    excess = err - tol
    if not (excess <= 0).all():
        flat = int(excess.argmax())
        r, c = divmod(flat, V)
        raise AssertionError(
            f"{kernel} rows={rows}: {int((excess > 0).sum())} logits outside tolerance; worst at "
            f"[{r}, {c}]: got {got[r, c].item():.6f}, ref {ref8[r, c].item():.6f}, tol {tol[r, c].item():.6f}, "
            f"sum|x||w| {head['s_deq'][r, c].item():.4f}; max abs err {err.max().item():.5f}")

    top = ref8.topk(2, dim=1)
    idx = torch.arange(rows, device=DEV)
    protected = (top.values[:, 0] - top.values[:, 1]) > tol[idx, top.indices[:, 0]] + tol[idx, top.indices[:, 1]]
    assert (got.argmax(dim=1)[protected] == top.indices[protected, 0]).all()

    # Against the original BF16 weights in fp32: quantization bound + kernel tolerance.
    err32 = (got - head["ref32"][:rows]).abs()
    assert (err32 <= head["quant_bound"][:rows] + tol).all()


@pytest.mark.parametrize("kernel", FAST_KERNELS)
def test_kernel_replays_in_a_cuda_graph(kernel, head):
    state = state_for(kernel, head)
    x = head["x"][:4].clone()
    eager = fp8_head_logits(x, state)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fp8_head_logits(x, state)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = fp8_head_logits(x, state)
    x.copy_(head["x"][4:8])
    graph.replay()
    torch.cuda.synchronize()
    # The replay must have computed the new rows (within the kernel tolerance of their reference).
    tol = kernel_tolerance(kernel, head, head["x"][:8], 8)[4:8]
    assert ((captured.float() - head["ref8"][4:8]).abs() <= tol).all()
    assert not torch.equal(captured, eager)


def test_humming_uses_the_tuning_table_on_tuned_archs(head):
    state = state_for("humming", head)
    cap = torch.cuda.get_device_capability()
    assert state.extra["tuning"] == ("table" if cap in HUMMING_TUNING_BY_ARCH else "heuristic")


def test_humming_state_is_half_the_bf16_head(head):
    state = state_for("humming", head)
    bf16_bytes = V * H * 2
    assert state.nbytes() <= bf16_bytes // 2 + V * 2 + 64 * 1024, state.nbytes()


def test_select_head_kernel_on_this_gpu(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    sel = select_head_kernel(DEV)
    name, reason = sel.choice, sel.reason
    assert name in FAST_KERNELS
    cap = torch.cuda.get_device_capability()
    if cap in HEAD_KERNEL_BY_ARCH:
        assert "measured" in reason
        assert name == HEAD_KERNEL_BY_ARCH[cap][0][0] or "skipped" in reason


def test_warmup_kernels_small_head(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    result = warmup_kernels(4096, H, row_counts=(1, 2, 4))
    assert result["row_counts"] == [1, 2, 4]
    assert result["kernel"] in FAST_KERNELS
