"""FP8 (e4m3) LM head on CPU: the scale rule, the quantization round trip, and logits against
an independent fp32 reference.

Tolerances and why:
- Round trip, per weight: ``|w - q*scale| <= 2**-4 * |w| + 2**-10 * scale``. e4m3 keeps 3
  mantissa bits, so round-to-nearest is off by at most half a step, 2**-4 of the value, for
  normal codes; subnormal codes (|q| < 2**-6) have a fixed step of 2**-9, half of it 2**-10
  (times the scale). Hence also ``<= 2**-4 * amax`` of the row.
- Logits, per element, fp8 path vs fp32 logits of the original weights:
  ``|fp8 - ref| <= 2**-4 * (|x| @ |w|.T) * (1 + 1e-5) + 2**-10 * scale * sum|x|`` (the sum of the
  per-weight bounds above; the 1e-5 covers fp32 summation order). This is a worst case, not a
  statistical guess, so it cannot flake.
- Argmax: must agree on every row whose fp32 top-1/top-2 margin exceeds the two entries'
  bounds added (then no error within the bound can swap them); top-5 set likewise with the
  5th/6th gap. Over all rows of the realistic batch, at least 90 % must agree (fixed seed;
  this batch gives 48/48, including the uncertain half whose margins are 0.02..4 logits, and
  23 rows are provably protected).
- The chunked CPU path vs a float64 matmul of the dequantized weights: relative 1e-5 of
  ``|x| @ |w_deq|.T`` (fp32 accumulation over 2560 terms, ~2560 * 2**-24 = 1.5e-4 worst case;
  1e-5 is what fp32 pairwise/blocked summation gives in practice on this size, and anything
  wrong with chunk boundaries is O(1)).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from vllm_ling.ops.lm_head.head import Fp8LmHead, fp8_head_logits, prepare_fp8_head
from vllm_ling.ops.lm_head.quantize import (dequantize_fp8_per_channel, quantize_fp8_per_channel,
                                           quantize_fp8_per_token, round_up_to_bf16)
from vllm_ling.ops.lm_head.reference import fp8_reference_logits, reference_logits
from vllm_ling.ops.lm_head.selection import HEAD_KERNEL_BY_ARCH, KERNELS, KERNEL_ENV, select_head_kernel
from vllm_ling.options import HeadKernel
from vllm_ling.selection import Feature, Selection
from vllm_ling.ops.lm_head.triton_kernel import triton_config_for

REPO = Path(__file__).resolve().parents[3]
H = 2560
E4M3_REL = 2.0**-4
E4M3_SUBNORMAL_ABS = 2.0**-10


def realistic_head(vocab: int, hidden: int = H, seed: int = 0, zero_rows=()) -> torch.Tensor:
    """BF16 head with trained-head-like structure: per-row norms spread log-normally, a few
    outlier hidden channels 8x larger (they set the row amax and so stress per-row scaling),
    and zero rows where vLLM pads the vocabulary."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn((vocab, hidden), generator=g) * 0.02
    w *= torch.exp(0.3 * torch.randn((vocab, 1), generator=g))
    outliers = torch.randperm(hidden, generator=g)[:8]
    w[:, outliers] *= 8.0
    for r in zero_rows:
        w[r] = 0.0
    return w.to(torch.bfloat16)


def realistic_hidden(weight: torch.Tensor, rows: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Final hidden states: noise plus a push along one token's row. The first half are
    confident (push 12: top-1 margins of 8..60 logits), the second half uncertain (push
    0..0.5: margins of 0.02..4 logits, where FP8 may legitimately flip)."""
    g = torch.Generator().manual_seed(seed)
    targets = torch.randint(0, weight.shape[0], (rows,), generator=g)
    push = torch.cat([torch.full((rows - rows // 2,), 12.0), 0.5 * torch.rand(rows // 2, generator=g)])
    direction = weight[targets].float()
    direction /= direction.norm(dim=1, keepdim=True).clamp_min(1e-12)
    x = torch.randn((rows, weight.shape[1]), generator=g) + push[:, None] * direction * 8.0
    return x.to(torch.bfloat16), targets


def logit_bound(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Per-element worst-case |fp8 logits - fp32 logits| from the per-weight bound."""
    ax = x.float().abs()
    mag = reference_logits(ax, w.float().abs())
    return E4M3_REL * mag * (1 + 1e-5) + E4M3_SUBNORMAL_ABS * scale[None, :] * ax.sum(dim=1, keepdim=True)


# ---------------------------------------------------------------------------------- scale rule


def test_round_up_to_bf16_is_the_smallest_bf16_not_below():
    g = torch.Generator().manual_seed(3)
    x = torch.exp(torch.randn(10000, generator=g) * 20).float()  # wide range of magnitudes
    x = torch.cat([x, torch.tensor([1.0, 2.0**-130, 3.0e38, 1.5])])  # exact, subnormal, huge
    up = round_up_to_bf16(x)
    assert torch.equal(up.to(torch.bfloat16).float(), up), "result must be bf16-representable"
    assert (up >= x).all()
    # The next bf16 value below `up` must be below x (so `up` is the smallest such value).
    below = torch.nextafter(up.to(torch.bfloat16), torch.tensor(0.0, dtype=torch.bfloat16)).float()
    assert (below < x).all()
    exact = x.to(torch.bfloat16).float() == x
    assert torch.equal(up[exact], x[exact]), "bf16 values must be kept unchanged"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantization_is_exact_on_representable_values(dtype):
    """Rows built as q * s with s a bf16 value and max |q| = 448 come back exactly."""
    g = torch.Generator().manual_seed(4)
    rows, cols = 64, 256
    all_codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    finite_codes = all_codes[torch.isfinite(all_codes)]
    q_true = finite_codes[torch.randint(0, finite_codes.numel(), (rows, cols), generator=g)]
    q_true[:, 0] = 448.0 * torch.where(torch.rand(rows, generator=g) < 0.5, -1.0, 1.0)
    if dtype == torch.bfloat16:  # power-of-two scales keep q * s exact in bf16's 8 bits
        s_true = torch.ldexp(torch.ones(rows), torch.randint(-20, 5, (rows,), generator=g))
    else:
        s_true = (torch.rand(rows, generator=g) * 1e-3 + 1e-4).to(torch.bfloat16).float()
    w = (q_true * s_true[:, None]).to(dtype)
    assert torch.equal(w.float(), q_true * s_true[:, None]), "test data must be exact"
    q, s = quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert torch.equal(s, s_true)
    assert torch.equal(q.float(), q_true)
    assert torch.equal(dequantize_fp8_per_channel(q, s), w.float())


def test_scale_rule_on_random_rows():
    w = realistic_head(512, seed=5)
    q, s = quantize_fp8_per_channel(w)
    amax = w.float().abs().amax(dim=1)
    assert torch.equal(s.to(torch.bfloat16).float(), s), "scales must be bf16-representable"
    assert (s >= amax / 448).all()
    assert (s <= amax / 448 * (1 + 2.0**-7)).all(), "rounded up by at most one bf16 step"
    qmax = q.float().abs().amax(dim=1)
    assert (qmax <= 448).all()
    assert (qmax >= 416).all(), "the largest weight must land in e4m3's top binade [416, 448]"


def test_zero_and_tiny_rows_are_finite():
    w = realistic_head(64, seed=6, zero_rows=(0, 17, 63)).float()
    w[5] = 0.0
    w[5, 3] = 1e-40  # subnormal in fp32 and bf16
    q, s = quantize_fp8_per_channel(w.to(torch.bfloat16))
    for r in (0, 17, 63):
        assert s[r] == 1.0
        assert torch.equal(q[r].float(), torch.zeros(w.shape[1]))
    assert torch.isfinite(s).all() and (s > 0).all()
    assert torch.isfinite(q.float()).all()
    deq = dequantize_fp8_per_channel(q, s)
    assert torch.isfinite(deq).all()


def test_nan_weight_is_rejected_with_its_row():
    w = realistic_head(32, seed=7)
    w[20, 5] = float("nan")
    with pytest.raises(ValueError, match="row 20"):
        quantize_fp8_per_channel(w, chunk_rows=8)


def test_bad_shapes_and_dtypes_are_rejected():
    with pytest.raises(ValueError, match="2-D"):
        quantize_fp8_per_channel(torch.zeros(3, 4, 5))
    with pytest.raises(ValueError, match="bf16/fp16/fp32"):
        quantize_fp8_per_channel(torch.zeros(3, 4, dtype=torch.int32))
    q, s = quantize_fp8_per_channel(torch.ones(4, 8))
    with pytest.raises(ValueError, match="one scale per vocabulary row"):
        dequantize_fp8_per_channel(q, s[:3])


def test_fp32_input_is_not_modified():
    w = realistic_head(40, seed=8).float()
    before = w.clone()
    quantize_fp8_per_channel(w, chunk_rows=16)
    assert torch.equal(w, before)


# ---------------------------------------------------------------------------------- round trip


def test_round_trip_error_bound_relative_to_value_and_row_amax():
    w = realistic_head(2048, seed=9, zero_rows=(7,))
    q, s = quantize_fp8_per_channel(w, chunk_rows=500)  # chunk boundaries inside the head
    w32 = w.float()
    err = (dequantize_fp8_per_channel(q, s) - w32).abs()
    bound = E4M3_REL * w32.abs() + E4M3_SUBNORMAL_ABS * s[:, None]
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    amax = w32.abs().amax(dim=1, keepdim=True)
    assert (err <= E4M3_REL * amax + 1e-30).all()
    # The bound is nearly reached (real rounding happens): max relative error over weights in
    # e4m3's normal range (|w| / scale >= 2**-6; below it the absolute subnormal term rules).
    normal = w32.abs() / s[:, None] >= 2.0**-6
    rel = (err[normal] / w32.abs()[normal]).max().item()
    assert 2.0**-5 < rel <= E4M3_REL


def test_chunked_quantization_equals_single_chunk():
    w = realistic_head(1000, seed=10)
    q1, s1 = quantize_fp8_per_channel(w, chunk_rows=10_000)
    q2, s2 = quantize_fp8_per_channel(w, chunk_rows=77)
    assert torch.equal(s1, s2)
    assert torch.equal(q1.view(torch.uint8), q2.view(torch.uint8))


# ---------------------------------------------------------------------------------- logits


@pytest.fixture(scope="module")
def head():
    w = realistic_head(6000, seed=11, zero_rows=(5990, 5995, 5999))  # padded tail rows
    q, s = quantize_fp8_per_channel(w)
    x, targets = realistic_hidden(w, 48, seed=12)
    return dict(w=w, q=q, s=s, x=x, targets=targets, ref=reference_logits(x, w))


def test_reference_logits_matches_float64(head):
    x, w = head["x"], head["w"]
    exact = x.double() @ w.double().t()
    got = reference_logits(x, w, chunk_rows=1001)
    scale = (x.double().abs() @ w.double().abs().t())
    assert got.dtype == torch.float32
    assert ((got.double() - exact).abs() <= 1e-5 * scale + 1e-30).all()


def test_cpu_path_matches_dequantized_float64(head):
    state = prepare_fp8_head(head["q"], head["s"], "torch", out_dtype=torch.float32)
    got = fp8_head_logits(head["x"], state)
    w_deq = head["q"].double() * head["s"].double()[:, None]
    exact = head["x"].double() @ w_deq.t()
    scale = head["x"].double().abs() @ w_deq.abs().t()
    assert got.dtype == torch.float32 and got.shape == exact.shape
    assert ((got.double() - exact).abs() <= 1e-5 * scale + 1e-30).all()
    chunked = fp8_reference_logits(head["x"], head["q"], head["s"], chunk_rows=999)
    assert torch.allclose(chunked, got, rtol=0, atol=1e-5 * scale.max().item())


def test_fp8_logits_within_worst_case_bound_of_fp32(head):
    state = prepare_fp8_head(head["q"], head["s"], "torch", out_dtype=torch.float32)
    got = fp8_head_logits(head["x"], state)
    ref = head["ref"]
    bound = logit_bound(head["x"], head["w"], head["s"])
    err = (got - ref).abs()
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    # Report-level facts that make the bound meaningful: typical error is far below it.
    assert err.max().item() < 0.5 * bound.max().item()
    # Padding rows stay exactly zero.
    assert torch.equal(got[:, [5990, 5995, 5999]], torch.zeros(got.shape[0], 3))


def test_fp8_argmax_and_top5_agree_where_the_margin_allows(head):
    state = prepare_fp8_head(head["q"], head["s"], "torch", out_dtype=torch.float32)
    got = fp8_head_logits(head["x"], state)
    ref = head["ref"]
    bound = logit_bound(head["x"], head["w"], head["s"])
    rows = torch.arange(ref.shape[0])

    top = ref.topk(6, dim=1)
    margin1 = top.values[:, 0] - top.values[:, 1]
    protected1 = margin1 > bound[rows, top.indices[:, 0]] + bound[rows, top.indices[:, 1]]
    agree1 = got.argmax(dim=1) == top.indices[:, 0]
    assert protected1.sum() >= ref.shape[0] // 3, "most confident rows must be provably protected"
    assert agree1[protected1].all()
    assert agree1.float().mean() >= 0.90

    gap5 = top.values[:, 4] - top.values[:, 5]
    protected5 = gap5 > bound[rows, top.indices[:, 4]] + bound[rows, top.indices[:, 5]]
    got5 = got.topk(5, dim=1).indices.sort(dim=1).values
    ref5 = top.indices[:, :5].sort(dim=1).values
    assert (got5[protected5] == ref5[protected5]).all()

    # The confident rows' argmax is the token the hidden state was pushed towards.
    confident = slice(0, ref.shape[0] - ref.shape[0] // 2)
    assert torch.equal(got.argmax(dim=1)[confident], head["targets"][confident])


def test_bf16_output_and_shapes(head):
    state = prepare_fp8_head(head["q"], head["s"], "torch")
    assert state.out_dtype == torch.bfloat16
    x3 = head["x"][:6].reshape(2, 3, H)
    got = fp8_head_logits(x3, state)
    assert got.shape == (2, 3, head["q"].shape[0]) and got.dtype == torch.bfloat16
    exact = fp8_reference_logits(head["x"][:6], head["q"], head["s"]).reshape(2, 3, -1)
    # bf16 output rounding: at most half a bf16 step (8 significant bits), 2**-8 relative.
    assert ((got.float() - exact).abs() <= 2.0**-8 * exact.abs() + 1e-30).all()
    empty = fp8_head_logits(head["x"][:0], state)
    assert empty.shape == (0, head["q"].shape[0])
    out = torch.empty(6, head["q"].shape[0], dtype=torch.bfloat16)
    assert fp8_head_logits(head["x"][:6], state, out=out).data_ptr() == out.data_ptr()
    with pytest.raises(ValueError, match="hidden size"):
        fp8_head_logits(torch.zeros(1, H + 1), state)


def test_fp8_lm_head_wrapper_from_bf16(head):
    small = head["w"][:300]
    lm_head = Fp8LmHead.from_bf16(small, kernel="torch", out_dtype=torch.float32)
    got = lm_head(head["x"][:4])
    q, s = quantize_fp8_per_channel(small)
    assert torch.equal(got, fp8_reference_logits(head["x"][:4], q, s))


# ---------------------------------------------------------------------------------- selection


def test_select_head_kernel_on_cpu_names_the_reason(monkeypatch):
    monkeypatch.delenv(KERNEL_ENV, raising=False)
    sel = select_head_kernel("cpu")
    assert sel.choice is HeadKernel.TORCH and sel.feature is Feature.HEAD_KERNEL
    assert "no CUDA device" in sel.reason


def test_forced_kernel_that_cannot_run_is_an_error(monkeypatch):
    monkeypatch.setenv(KERNEL_ENV, "humming")
    with pytest.raises(ValueError, match=f"{KERNEL_ENV}='humming' cannot run on cpu: humming needs a CUDA"):
        select_head_kernel("cpu")
    monkeypatch.setenv(KERNEL_ENV, "torch")
    assert select_head_kernel("cpu") == Selection(Feature.HEAD_KERNEL, HeadKernel.TORCH, f"forced by {KERNEL_ENV}")
    with pytest.raises(ValueError, match="unknown LM-head kernel 'cublas'"):
        select_head_kernel("cpu", preferred="cublas")
    q, s = quantize_fp8_per_channel(torch.ones(16, 32))
    with pytest.raises(ValueError, match="triton needs a CUDA device"):
        prepare_fp8_head(q, s, "triton")


def test_arch_table_names_only_known_kernels_with_evidence():
    for arch, (order, evidence) in HEAD_KERNEL_BY_ARCH.items():
        assert order and set(order) <= set(KERNELS) - {"torch"}, arch
        cited = re.search(r"benchmarks/results/[\w.]+\.md", evidence)  # the measurement behind the row
        assert cited and (REPO / cited.group(0)).is_file(), (arch, evidence)
    assert triton_config_for(1).block_m == 1
    for rows in (2, 3, 16, 17, 64, 1000):
        cfg = triton_config_for(rows)
        assert cfg.use_dot and cfg.block_m >= 16


def test_per_token_activation_quantization_bound():
    g = torch.Generator().manual_seed(13)
    x = torch.randn(8, H, generator=g)
    x[3] = 0.0
    xq, sx = quantize_fp8_per_token(x)
    assert sx.shape == (8, 1) and sx[3, 0] == 1.0
    err = (xq.float() * sx - x).abs()
    assert (err <= E4M3_REL * x.abs() + E4M3_SUBNORMAL_ABS * sx).all()
