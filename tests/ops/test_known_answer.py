"""Known-answer problems (vllm_ling.ops.known_answer): their answers are right, correct
plain-PyTorch kernels pass them, and every planted fault fails with a message naming it."""

from __future__ import annotations

import math

import known_answer_faults as faults  # tests/known_answer_faults.py
import pytest
import torch

from vllm_ling.ops import known_answer as ka
from vllm_ling.ops.fp8 import block_fp8_dequantize
from vllm_ling.ops.lm_head import fp8_reference_logits
from vllm_ling.ops.lm_head.quantize import quantize_fp8_per_token
from vllm_ling.ops.moe import experts_reference
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, SwigluClamp

AMX_CODES = "0x00-0x07 0x80-0x87"  # every e4m3 code with exponent field 0


def test_e4m3_table_agrees_with_torch_on_every_finite_code():
    codes = torch.tensor(ka.FINITE_E4M3_CODES, dtype=torch.uint8)
    assert torch.equal(ka.E4M3_TABLE[codes.long()], codes.view(torch.float8_e4m3fn).double())
    assert [math.isnan(ka.e4m3_value(c)) for c in ka.E4M3_NAN_CODES] == [True, True]
    assert ka.e4m3_value(0x01) == 2.0 ** -9 and ka.e4m3_value(0x7E) == 448.0


def test_code_ranges():
    assert ka.code_ranges([0, 1, 2, 7, 0x80]) == "0x00-0x02 0x07 0x80"


def _dense_problem():
    return ka.block_fp8_linear_problem()


def test_dense_problem_covers_every_finite_code_each_scale_and_an_all_zero_block():
    p = _dense_problem()
    codes = p.weight.view(torch.uint8)
    assert set(codes[:128, :128].unique().tolist()) == set(ka.FINITE_E4M3_CODES)
    assert set(codes[128:, 128:].unique().tolist()) == set(ka.FINITE_E4M3_CODES)
    assert codes[:128, 128:].eq(0).all() and p.scale_inv[0, 1] == 1.0
    assert p.scale_inv.tolist() == [[1.0, 1.0], [2.0 ** -24, 2.0 ** 16]]


def _dense_forward(values):
    return lambda inp: torch.nn.functional.linear(inp["x"], values.to(torch.bfloat16))


def test_dequantized_linear_passes_the_dense_check():
    p = _dense_problem()
    w = block_fp8_dequantize(p.weight, p.scale_inv, p.block, torch.bfloat16)
    r = ka.run_check("dense_fp8", "dequantized", p.cases, _dense_forward(w))
    assert r.passed and r.failing_inputs == [] and r.max_error <= r.tolerance, r.message()
    assert r.cases == 2


def _scales(p):
    return p.scale_inv.repeat_interleave(128, 0).repeat_interleave(128, 1)


def test_amx_defect_emulation_fails_with_the_exact_message():
    p = _dense_problem()
    r = ka.run_check("dense_fp8", "amx", p.cases, _dense_forward(faults.amx_e4m3_decode(p.weight) * _scales(p)))
    assert not r.passed
    # 0x00 at block scale 1 reads 2^-7 where 0 is expected: error / (0 + 2^-12) = 32.
    assert r.max_error == 32.0 and r.tolerance == ka.ONE_HOT_RTOL
    assert r.failing_inputs[0] == (
        f"256 one-hot rows (GEMM-sized): wrong e4m3 codes {AMX_CODES} in blocks [0,0] x2^0, "
        "[0,1] x2^0 (all-zero), [1,0] x2^-24, [1,1] x2^16")
    assert r.message() == ("dense_fp8 [amx]: max relative error 32 > tolerance 0.00781 on "
                           + "; ".join(r.failing_inputs))


def test_off_by_one_block_scale_exponent_fails():
    p = _dense_problem()
    w = p.weight.float() * _scales(p) * 2  # every block scale one exponent too high
    r = ka.run_check("dense_fp8", "scale+1", p.cases, _dense_forward(w))
    assert not r.passed and r.max_error == pytest.approx(1.0, rel=1e-2)
    # every nonzero code is wrong; the all-zero block stays right
    assert r.failing_inputs[0] == ("256 one-hot rows (GEMM-sized): wrong e4m3 codes 0x01-0x7e 0x81-0xfe in "
                                   "blocks [0,0] x2^0, [1,0] x2^-24, [1,1] x2^16")
    assert r.failing_inputs[1].startswith("1 random row (decode-sized)")


def test_a_raising_kernel_fails_naming_the_exception():
    p = _dense_problem()

    def boom(inp):
        raise RuntimeError("no kernel")

    r = ka.run_check("dense_fp8", "x", p.cases, boom)
    assert not r.passed and math.isinf(r.max_error) and r.as_dict()["max_error"] is None
    assert r.failing_inputs[0] == "256 one-hot rows (GEMM-sized): raised RuntimeError: no kernel"


def test_head_torch_kernel_passes_and_a_zero_code_fault_fails():
    assert ka.check_fp8_head_kernel("torch", "cpu").passed
    r = ka.check_fp8_head_kernel("torch", "cpu", plant=faults.plant_head_zero_code_fault)
    assert not r.passed and r.max_error == 32.0
    assert r.failing_inputs == ["256 one-hot rows (GEMM-sized): wrong e4m3 codes 0x00 0x80 in 256 rows "
                                "(scales 2^-20..7168)"]
    r = ka.check_fp8_head_kernel("torch", "cpu", plant=faults.plant_head_scale_fault)
    assert not r.passed and r.max_error == pytest.approx(1.0, rel=1e-6)
    assert [f.split(":")[0] for f in r.failing_inputs] == ["256 one-hot rows (GEMM-sized)", "1 random row (decode-sized)"]


def _per_token_fp8(x: torch.Tensor, dtype=torch.float8_e4m3fn, max_code: float | None = None) -> torch.Tensor:
    """Plain-PyTorch W8A8 activation rounding, written apart from vllm_ling.ops.lm_head: dynamic
    per-token scale amax / ``max_code`` (default: the format's largest value), round to
    ``dtype``, scale back (fp32)."""
    x32 = x.float()
    amax = x32.abs().amax(-1, keepdim=True)
    max_code = torch.finfo(dtype).max if max_code is None else max_code
    scale = torch.where(amax > 0, amax / max_code, torch.ones_like(amax))
    return (x32 / scale).to(dtype).float() * scale


@pytest.mark.parametrize("hidden, seed", [(256, 0), (256, 1), (256, 2), (2560, 0)])  # the check's size, Ling's
def test_head_random_row_is_exact_under_per_token_fp8_quantization(hidden, seed):
    """The head's random row survives a W8A8 kernel's dynamic per-token quantization bit for
    bit (its amax is 448 * 2^-8, so the scale is exactly 2^-8): the answer it owes is unchanged."""
    x = ka.fp8_head_problem(vocab=16, hidden=hidden, seed=seed).cases[1].inputs["x"]
    assert torch.equal(_per_token_fp8(x).to(torch.bfloat16), x)
    codes, scale = quantize_fp8_per_token(x)  # what the "scaled_mm" kernel runs
    assert float(scale) == 2.0 ** -8 and torch.equal(codes.double() * 2.0 ** -8, x.double())


def test_head_check_holds_scaled_mm_to_the_dense_tolerance(monkeypatch):
    """check_fp8_head_kernel("scaled_mm") end to end: prepare_fp8_head offers it on CUDA only,
    but torch._scaled_mm and the kernel's per-token quantization run on CPU too. The random row
    is within the dense tolerance (no wider one for a kernel quantizing activations), and a
    planted scale fault still fails both cases."""
    import vllm_ling.ops.lm_head.head as head_module

    monkeypatch.setattr(head_module, "kernel_unavailable_reason", lambda kernel, device: None)
    r = ka.check_fp8_head_kernel("scaled_mm", "cpu")
    assert r.passed and r.max_error <= ka.DENSE_ROW_RTOL / 4, r.message()
    r = ka.check_fp8_head_kernel("scaled_mm", "cpu", plant=faults.plant_head_scale_fault)
    assert not r.passed and r.max_error == pytest.approx(1.0, rel=1e-2), r.message()
    assert [f.split(" (")[0] for f in r.failing_inputs] == ["256 one-hot rows", "1 random row"]


def _w8a8_head(p, x_map=lambda x: _per_token_fp8(x)):
    return lambda inp: fp8_reference_logits(x_map(inp["x"]), p.weight, p.scale).to(torch.bfloat16)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_plain_w8a8_head_passes_at_the_dense_tolerance(seed):
    """One tolerance for every head kernel: with a Gaussian random row the FP8 rounding of the
    activations alone cost 2-3 % per row, so the check had to ask for the kernel's name."""
    p = ka.fp8_head_problem(seed=seed)
    assert [c.rtol for c in p.cases] == [ka.ONE_HOT_RTOL, ka.DENSE_ROW_RTOL]
    r = ka.run_check("fp8_head", "plain-PyTorch W8A8", p.cases, _w8a8_head(p))
    assert r.passed and r.max_error <= ka.DENSE_ROW_RTOL / 4, r.message()


WRONG_W8A8_HEADS = {  # name -> (activation map, cases that must fail)
    "activation scale amax/240 (e4m3fnuz's max)": (lambda x: _per_token_fp8(x, max_code=240.0), ["1 random row"]),
    "e5m2 activations": (lambda x: _per_token_fp8(x, torch.float8_e5m2), ["1 random row"]),
    "drops the last hidden column": (lambda x: _per_token_fp8(torch.nn.functional.pad(x[..., :-1], (0, 1))),
                                     ["256 one-hot rows", "1 random row"]),
}


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
@pytest.mark.parametrize("fault", list(WRONG_W8A8_HEADS))
def test_head_kernels_quantizing_activations_wrongly_fail(fault, seed):
    """Activation rounding a few percent off: only the random row at the dense tolerance sees
    the first two, so a tolerance widened for W8A8 kernels would let them through."""
    x_map, failing = WRONG_W8A8_HEADS[fault]
    p = ka.fp8_head_problem(seed=seed)
    r = ka.run_check("fp8_head", fault, p.cases, _w8a8_head(p, x_map))
    assert not r.passed and r.max_error > 2 * ka.DENSE_ROW_RTOL, r.message()
    assert [f.split(" (")[0] for f in r.failing_inputs] == failing, r.message()


def _reference_experts(tensors, top_k, clamp=ROUTED_EXPERT_CLAMP):
    return lambda x, w, ids, limit: experts_reference(
        x, tensors["w13_weight"], tensors["w2_weight"], w, ids, limit,
        w13_scale=tensors["w13_weight_scale"], w2_scale=tensors["w2_weight_scale"], clamp=clamp)


SMALL = dict(hidden=64, intermediate=64, token_counts=(4,))
MODE_CASE = f"4 tokens (decode-sized), SwiGLU clamp {ka.MOE_MODE_LIMIT:g} after the SiLU"


def test_moe_problem_covers_codes_scales_and_the_clamp():
    p = ka.mxfp4_moe_problem(**SMALL)
    codes = torch.stack((p.w13_weight & 0xF, p.w13_weight >> 4), -1)
    assert set(codes[0].unique().tolist()) == set(range(16))
    exps = torch.cat((p.w13_weight_scale.flatten(), p.w2_weight_scale.flatten())).int() - 127
    assert exps.min() == -24 and exps.max() == 28
    plain, clamped = p.cases[0], p.cases[1]
    assert clamped.inputs["swiglu_limit"] == ka.MOE_SWIGLU_LIMIT
    rel = (plain.reference - clamped.reference).norm(dim=-1) / plain.reference.norm(dim=-1)
    assert (rel > 0.5).sum() >= 2  # the clamp really bites (regimes A and D)


def test_moe_reference_method_passes():
    r = ka.check_mxfp4_experts(_reference_experts, "reference", "cpu", **SMALL)
    assert r.passed and r.cases == 3, r.message()


@pytest.mark.parametrize("w4a8", [False, True])
@pytest.mark.parametrize("sizes", [SMALL, {}], ids=["small (CPU check)", "default (GPU check)"])
def test_moe_mode_case_answers_differ_between_clamp_modes_by_far_more_than_the_tolerance(w4a8, sizes):
    """The clamp mode can fail a kernel only on the MOE_MODE_LIMIT cases: there the two modes'
    answers differ by > 4x the tolerance (W4A8's 5 %; 13x W4A16's 2 %) on every row off regime B
    (gates above L), while at Ling's own limit 7 they differ by < 0.2 % (why the mode case exists)."""
    ours = ka.mxfp4_moe_problem(w4a8=w4a8, **sizes)
    other = ka.mxfp4_moe_problem(w4a8=w4a8, clamp=SwigluClamp.GATE_INPUT, **sizes)
    mode_cases = 0
    for a, b in zip(ours.cases, other.cases):
        rel = (a.reference - b.reference).norm(dim=-1) / a.reference.norm(dim=-1)
        if a.inputs["swiglu_limit"] == ka.MOE_MODE_LIMIT:
            mode_cases += 1
            assert a.label.endswith("after the SiLU") and b.label.endswith("before the SiLU")
            tokens_on_b = torch.arange(len(rel)) % len(ka.MOE_REGIMES) == 1  # token t is on regime t % 4
            assert (rel[~tokens_on_b] > 4 * a.rtol).all(), (a.label, rel)
        else:
            assert (rel < 2e-3).all(), (a.label, rel)
    assert mode_cases == len(sizes.get("token_counts", (4, 40)))


@pytest.mark.parametrize("w4a8", [False, True])
def test_moe_method_in_the_pre_silu_mode_fails_the_mode_case_only(w4a8):
    """A planted wrong mode (vLLM 0.32's clamp before the SiLU) is caught, on exactly the case
    with gates above the limit, naming the regimes whose gates are there (B's are ~1e-5)."""
    def pre_silu(tensors, top_k):
        return lambda x, w, ids, limit: experts_reference(
            x, tensors["w13_weight"], tensors["w2_weight"], w, ids, limit, fp8_activations=w4a8,
            w13_scale=tensors["w13_weight_scale"], w2_scale=tensors["w2_weight_scale"],
            clamp=SwigluClamp.GATE_INPUT)

    r = ka.check_mxfp4_experts(pre_silu, "reference, clamp before the SiLU", "cpu", w4a8=w4a8, **SMALL)
    assert not r.passed and r.max_error > 5 * r.tolerance, r.message()
    assert r.failing_inputs == [f"{MODE_CASE}: tokens on experts A (all 16 e2m1 codes, scales ~2^0); C (codes "
                                "+-0.5 only); D (all codes, gate_up scales ~2^4 (SwiGLU clamp region), down ~2^-22)"]


@pytest.mark.parametrize("fault, expected", [
    ("swapped nibbles", 1.0),
    ("scale exponent +1", 1.0),
])
def test_moe_planted_faults_fail_with_the_exact_message(fault, expected):
    if fault == "swapped nibbles":
        plant = lambda t: {**t, "w13_weight": faults.swap_nibbles(t["w13_weight"])}  # noqa: E731
    else:
        plant = lambda t: {**t, "w2_weight_scale": faults.bump_e8m0(t["w2_weight_scale"])}  # noqa: E731
    r = ka.check_mxfp4_experts(_reference_experts, "reference", "cpu", plant=plant, **SMALL)
    assert not r.passed and r.max_error > 0.5
    every = ("tokens on experts A (all 16 e2m1 codes, scales ~2^0); B (all codes, gate_up scales ~2^-20, "
             "down ~2^26); C (codes +-0.5 only); D (all codes, gate_up scales ~2^4 (SwiGLU clamp region), "
             "down ~2^-22)")
    if fault == "scale exponent +1":  # down doubled: exactly 100 % error on every token
        assert r.max_error == pytest.approx(expected, abs=1e-6)
    assert r.failing_inputs == [f"4 tokens (decode-sized), no clamp: {every}",
                                f"4 tokens (decode-sized), SwiGLU clamp 7: {every}", f"{MODE_CASE}: {every}"]
    assert r.message() == (f"moe_mxfp4 [reference]: max relative error {r.max_error:.3g} > tolerance 0.02 on "
                           + "; ".join(r.failing_inputs))


def test_kda_serving_ops_pass_and_planted_faults_fail():
    from vllm_ling.ops import kda

    assert ka.check_kda(kda.kda_prefill_pooled, kda.kda_decode_pooled, "ops.kda").passed

    def prefill_ignoring_stored_state(q, k, v, g, beta, pool, cu, slots, has_init, scale):
        return kda.kda_prefill_pooled(q, k, v, g, beta, pool, cu, slots, None if has_init is None
                                      else torch.zeros_like(has_init), scale)

    r = ka.check_kda(prefill_ignoring_stored_state, kda.kda_decode_pooled, "no initial state")
    assert not r.passed and r.failing_inputs[0] == (
        "prefill of 5 + 21 tokens (chunked; 2nd from a stored state): 21 of 26 outputs")

    def decode_with_decay_sign_flipped(q, k, v, g, beta, *rest):
        return kda.kda_decode_pooled(q, k, v, -g, beta, *rest)

    r = ka.check_kda(kda.kda_prefill_pooled, decode_with_decay_sign_flipped, "exp(-g)")
    assert not r.passed
    assert r.failing_inputs == ["1 decode token per sequence (from the prefill's states): 2 of 2 outputs"]


def test_w4a8_answers_round_activations_like_a_w4a8_kernel():
    """The W4A8 answers agree with the ops reference's FP8 activation emulation, and differ
    from the BF16 answers by more than the W4A16 tolerance (the rounding is really there)."""
    def w4a8_reference(tensors, top_k):
        return lambda x, w, ids, limit: experts_reference(
            x, tensors["w13_weight"], tensors["w2_weight"], w, ids, limit, fp8_activations=True,
            w13_scale=tensors["w13_weight_scale"], w2_scale=tensors["w2_weight_scale"])

    r = ka.check_mxfp4_experts(w4a8_reference, "reference W4A8", "cpu", w4a8=True, **SMALL)
    assert r.passed and r.tolerance == ka.MOE_W4A8_ROW_RTOL, r.message()
    bf16 = ka.check_mxfp4_experts(w4a8_reference, "reference W4A8 vs BF16 answers", "cpu", **SMALL)
    assert bf16.max_error > ka.MOE_ROW_RTOL


def test_unjudged_rows_are_ignored_but_judged_rows_still_fail():
    p = ka.mxfp4_moe_problem(w4a8=True, **SMALL)
    case = p.cases[0]
    assert case.judged_rows.tolist() == [True, False, True, True]  # tokens on A, B, C, D
    bad_b_only = case.reference.clone()
    bad_b_only[1] *= 2
    r = ka.run_check("moe_mxfp4", "x", [case], lambda inp: bad_b_only)
    assert r.passed
    bad_a = case.reference.clone()
    bad_a[0] *= 2
    r = ka.run_check("moe_mxfp4", "x", [case], lambda inp: bad_a)
    assert r.failing_inputs == ["4 tokens (decode-sized), no clamp: tokens on experts A (all 16 e2m1 codes, "
                                "scales ~2^0)"]


def test_router_problem_answers_and_planted_faults():
    from vllm_ling.ops.small_gemv.router import reference_router_logits

    from vllm_ling.ops.small_gemv.router import MAX_ROWS
    from vllm_ling.ops.small_gemv.kernel import default_launch, launch_row_counts

    p = ka.router_gemv_problem(256)
    assert [c.label for c in p.cases][:2] == ["1 token x 13 experts x 256", "2 tokens x 13 experts x 256"]
    assert p.cases[-1].label == f"{MAX_ROWS} tokens x 13 experts x 256"
    # every launch shape the kernel picks for a gate runs in its check: for the test gate and for
    # Ling's 512-expert gate, whose wide-gate shapes the 13-expert problem would not reach
    for experts in (13, 512):
        rows = launch_row_counts(experts)
        assert {default_launch(r, experts) for r in rows} == {default_launch(r, experts) for r in range(1, MAX_ROWS + 1)}
        assert 1 in rows and MAX_ROWS in rows
    assert {default_launch(r, 512) for r in launch_row_counts(512)} - {default_launch(r, 13) for r in launch_row_counts(13)}
    one_hot = p.cases[1].inputs["x"][1].double()
    assert one_hot.sum() == 1 and torch.equal(p.cases[1].reference[1], p.weight.double()[:, -1])
    assert (p.weight[2] == 0).all() and p.weight[0].abs().max() > 2.0 ** 30  # zero and far-scaled expert rows

    exact = ka.check_router_gemv(lambda x, w: reference_router_logits(x, w).float(), "float64 reference", 2560)
    fp32 = ka.check_router_gemv(lambda x, w: x.float() @ w.t(), "fp32 matmul", 2560)  # any fp32 order passes
    assert exact.passed and fp32.passed and fp32.tolerance == 2.0 ** -16, fp32.message()

    bf16_weight = ka.check_router_gemv(lambda x, w: (x.float() @ w.bfloat16().float().t()), "bf16 weights", 2560)
    assert not bf16_weight.passed  # a kernel reading the fp32 gate as BF16 loses the router's precision
    last_column = ka.check_router_gemv(lambda x, w: x[:, :-1].float() @ w[:, :-1].t(), "drops column H-1", 256)
    assert not last_column.passed and "tokens 0 (random), 1 (one-hot)" in last_column.failing_inputs[1]

    def zero_row_garbage(x, w):
        out = x.float() @ w.t()
        out[:, 2] = 1e-3
        return out

    r = ka.check_router_gemv(zero_row_garbage, "zero expert written", 256)
    assert r.failing_inputs[0] == ("1 token x 13 experts x 256: 1 of 13 logits off by more than 2^-16 of "
                                   "|x|.|w|: tokens 0 (random); experts 2 (zero)")
