"""Known-answer checks against the real GPU kernels (H200): humming's indexed MoE GEMM, the
fused MoE decode kernels, and every FP8 LM-head kernel. Each passes on the known answers of
vllm_ling.ops.known_answer and fails, naming the inputs, on a planted fault (wrong decode of
code 0, swapped nibble order, scale exponent off by one, the SwiGLU clamp before the SiLU)."""

from __future__ import annotations

import known_answer_faults as faults  # tests/known_answer_faults.py
import pytest
import torch

from vllm_ling.ops import known_answer as ka

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():
    pytest.skip("needs CUDA", allow_module_level=True)

from vllm_ling.ops import moe  # noqa: E402
from vllm_ling.ops.moe.activation import ROUTED_EXPERT_CLAMP, SwigluClamp  # noqa: E402

DEV = torch.device("cuda")
HEAD_KERNELS = ("humming", "triton", "scaled_mm", "torch")
ALL_REGIMES = ("tokens on experts A (all 16 e2m1 codes, scales ~2^0); B (all codes, gate_up scales ~2^-20, "
               "down ~2^26); C (codes +-0.5 only); D (all codes, gate_up scales ~2^4 (SwiGLU clamp region), "
               "down ~2^-22)")
MODE_CASES = (f"4 tokens (decode-sized), SwiGLU clamp {ka.MOE_MODE_LIMIT:g} after the SiLU",
              f"40 tokens (GEMM-sized), SwiGLU clamp {ka.MOE_MODE_LIMIT:g} after the SiLU")
MOE_CASES = ("4 tokens (decode-sized), no clamp", "4 tokens (decode-sized), SwiGLU clamp 7", MODE_CASES[0],
             "40 tokens (GEMM-sized), no clamp", "40 tokens (GEMM-sized), SwiGLU clamp 7", MODE_CASES[1])
GATES_ABOVE_THE_LIMIT = ("tokens on experts A (all 16 e2m1 codes, scales ~2^0); C (codes +-0.5 only); D (all codes, "
                         "gate_up scales ~2^4 (SwiGLU clamp region), down ~2^-22)")


@pytest.fixture(autouse=True)
def no_tf32():
    old = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32 = old


def _head(kernel, plant=None):
    try:
        return ka.check_fp8_head_kernel(kernel, DEV, plant=plant)
    except ValueError as exc:  # prepare_fp8_head: "cannot run on ..." (arch, missing package)
        pytest.skip(str(exc))


@pytest.mark.parametrize("kernel", HEAD_KERNELS)
def test_head_kernel_passes_its_known_answers(kernel):
    r = _head(kernel)
    print(r.message(), f"{r.seconds:.3f} s")
    assert r.passed, r.message()


@pytest.mark.parametrize("kernel", HEAD_KERNELS)
def test_head_kernel_reading_zero_as_2_pow_minus_7_fails(kernel):
    r = _head(kernel, faults.plant_head_zero_code_fault)
    assert not r.passed
    assert r.failing_inputs == ["256 one-hot rows (GEMM-sized): wrong e4m3 codes 0x00 0x80 in 256 rows "
                                "(scales 2^-20..7168)"], r.message()


@pytest.mark.parametrize("kernel", HEAD_KERNELS)
def test_head_kernel_with_scale_off_by_one_exponent_fails(kernel):
    r = _head(kernel, faults.plant_head_scale_fault)
    assert not r.passed and r.max_error == pytest.approx(1.0, rel=2e-2), r.message()
    assert [f.split(":")[0] for f in r.failing_inputs] == ["256 one-hot rows (GEMM-sized)",
                                                           "1 random row (decode-sized)"]


def _humming_builder(decode: str, w4a8: bool = False, built: list | None = None, clamp=ROUTED_EXPERT_CLAMP):
    ok, reason = moe.humming_status(w4a8=w4a8)
    if not ok:
        pytest.skip(f"humming cannot run here: {reason}")

    def build(tensors, top_k):
        experts = moe.HummingMxfp4Experts(**tensors, w4a8=w4a8, top_k=top_k, decode=decode, clamp=clamp)
        if built is not None:
            built.append(experts)
        return experts
    return build


@pytest.mark.parametrize("decode", ["auto", "copy", "off"])
def test_humming_moe_passes_its_known_answers(decode):
    """decode auto/copy: 4 tokens through the fused decode kernels, 40 through humming's GEMM;
    off: both through humming's GEMM."""
    built = []
    r = ka.check_mxfp4_experts(_humming_builder(decode, built=built), f"humming decode={decode}", DEV)
    print(r.message(), f"{r.seconds:.3f} s", built[0].decode_status)
    assert r.passed, r.message()
    assert (built[0].decoder is not None) == (decode != "off"), built[0].decode_status


@pytest.mark.parametrize("decode", ["auto", "off"])
@pytest.mark.parametrize("fault", ["swapped nibbles", "scale exponent +1"])
def test_humming_moe_planted_faults_fail_naming_every_case(decode, fault):
    if fault == "swapped nibbles":
        plant = lambda t: {**t, "w13_weight": faults.swap_nibbles(t["w13_weight"])}  # noqa: E731
    else:
        plant = lambda t: {**t, "w2_weight_scale": faults.bump_e8m0(t["w2_weight_scale"])}  # noqa: E731
    r = ka.check_mxfp4_experts(_humming_builder(decode), f"humming decode={decode}", DEV, plant=plant)
    assert not r.passed and r.max_error > 0.5, r.message()
    assert r.failing_inputs == [f"{case}: {ALL_REGIMES}" for case in MOE_CASES], r.message()


def test_humming_moe_w4a8_passes_its_known_answers():
    r = ka.check_mxfp4_experts(_humming_builder("off", w4a8=True), "humming W4A8", DEV, w4a8=True)
    print(r.message(), f"{r.seconds:.3f} s")
    assert r.passed, r.message()


@pytest.mark.parametrize("decode", ["auto", "copy", "off"])
def test_humming_moe_clamping_before_the_silu_fails_exactly_the_mode_cases(decode):
    """Issue 43, the planted wrong mode on the GPU: humming's activation expression (40 tokens; and
    4 with decode off) and the decode kernels' CLAMP_GATE_OUTPUT=0 build (4 tokens: humming's
    layout with auto, the packed copy with copy) computing vLLM 0.32's silu(min(g, L)) fail the
    cases whose gates exceed the limit, and only those."""
    built = []
    r = ka.check_mxfp4_experts(_humming_builder(decode, built=built, clamp=SwigluClamp.GATE_INPUT),
                               f"humming decode={decode}, clamp before the SiLU", DEV)
    print(r.message(), built[0].decode_status)
    assert (built[0].decoder is not None) == (decode != "off"), built[0].decode_status
    assert not r.passed and r.max_error > 5 * r.tolerance, r.message()
    assert r.failing_inputs == [f"{case}: {GATES_ABOVE_THE_LIMIT}" for case in MODE_CASES], r.message()


def test_humming_moe_w4a8_clamping_before_the_silu_fails_exactly_the_mode_cases():
    r = ka.check_mxfp4_experts(_humming_builder("off", w4a8=True, clamp=SwigluClamp.GATE_INPUT),
                               "humming W4A8, clamp before the SiLU", DEV, w4a8=True)
    assert not r.passed and r.max_error > 4 * r.tolerance, r.message()
    assert r.failing_inputs == [f"{case}: {GATES_ABOVE_THE_LIMIT}" for case in MODE_CASES], r.message()
