"""Known-answer checks through vLLM quant methods (scratch layers), and the CPU dense-FP8
path decision: vLLM's AMX kernel serves only if it passes its check."""

from __future__ import annotations

import logging
import math

import known_answer_faults as faults  # tests/known_answer_faults.py
import pytest
import torch

pytest.importorskip("vllm")


AMX_CODES = "0x00-0x07 0x80-0x87"
# What vLLM-CPU's kernel selection and vllm-ling's path decision both read (not /proc/cpuinfo,
# which can disagree with it, e.g. when the OS has not enabled AMX tiles for the process).
HAS_AMX = torch.cpu._is_amx_tile_supported()


@pytest.fixture(scope="module")
def tp1(loaded_tiny_models):
    """Model-parallel groups of one rank (vLLM's parameters read their TP rank when built),
    set up by the session's loaded tiny models."""


def _amx_defect_method_class():
    """CpuBlockFp8LinearMethod whose load-time decode has vLLM-CPU 0.32's AMX defect."""
    from vllm.model_executor.utils import replace_parameter

    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod

    class AmxDefectLinearMethod(CpuBlockFp8LinearMethod):
        def process_weights_after_loading(self, layer):
            bn, bk = self.weight_block_size
            scale = layer.weight_scale_inv.data.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
            replace_parameter(layer, "weight", (faults.amx_e4m3_decode(layer.weight.data) * scale).to(layer.orig_dtype))
            del layer.weight_scale_inv

    return AmxDefectLinearMethod


@pytest.mark.parametrize("e8m0", [True, False])
def test_dequantized_cpu_method_passes(tp1, e8m0):
    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod
    from vllm_ling.layers.known_answer import check_dense_fp8_method

    r = check_dense_fp8_method(CpuBlockFp8LinearMethod([128, 128], e8m0))
    assert r.passed and r.kernel == "CpuBlockFp8LinearMethod" and r.cases == 2, r.message()


def test_amx_defect_variant_fails_with_the_exact_message(tp1):
    from vllm_ling.layers.known_answer import check_dense_fp8_method

    r = check_dense_fp8_method(_amx_defect_method_class()([128, 128], True))
    assert not r.passed and r.max_error == 32.0
    assert r.message() == (
        "dense_fp8 [AmxDefectLinearMethod]: max relative error 32 > tolerance 0.00781 on 256 one-hot rows "
        f"(GEMM-sized): wrong e4m3 codes {AMX_CODES} in blocks [0,0] x2^0, [0,1] x2^0 (all-zero), "
        "[1,0] x2^-24, [1,1] x2^16")  # the random row's error stays under its tolerance


def test_scratch_check_leaves_the_method_it_copies_alone(tp1):
    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod
    from vllm_ling.layers.known_answer import check_dense_fp8_method

    method = CpuBlockFp8LinearMethod([128, 128], True)
    before = dict(vars(method))
    check_dense_fp8_method(method)
    assert vars(method) == before


def test_decision_without_amx_never_runs_vllms_kernel():
    from vllm_ling.layers.dense_fp8_path import DEQUANTIZED, choose_cpu_dense_fp8_path

    def must_not_run():
        raise AssertionError("vLLM's AMX kernel must not run on a CPU without AMX")

    path = choose_cpu_dense_fp8_path(False, must_not_run)
    assert path.kernel == DEQUANTIZED and path.check is None
    assert path.reason == "CPU without AMX: vLLM-CPU has no block-FP8 kernel"


def test_decision_with_amx_uses_vllms_kernel_only_if_it_passes(tp1, caplog):
    """AMX reported present: a kernel with the AMX defect is refused with one WARNING naming
    vLLM's defect; a correct kernel is used."""
    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod
    from vllm_ling.layers.dense_fp8_path import (DEQUANTIZED, VLLM_AMX, VLLM_AMX_DEFECT,
                                                  choose_cpu_dense_fp8_path)
    from vllm_ling.layers.known_answer import check_dense_fp8_method
    from vllm_ling.log import _once

    good = choose_cpu_dense_fp8_path(True, lambda: check_dense_fp8_method(CpuBlockFp8LinearMethod([128, 128], True)))
    assert good.kernel == VLLM_AMX and good.check.passed
    _once.discard(("vllm.ling.quant", "dense-fp8-amx-defect"))
    bad_method = _amx_defect_method_class()([128, 128], True)
    with caplog.at_level(logging.WARNING, logger="vllm.ling"):
        for _ in range(2):
            bad = choose_cpu_dense_fp8_path(True, lambda: check_dense_fp8_method(bad_method))
    assert bad.kernel == DEQUANTIZED and not bad.check.passed
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert warnings == [
        f"Dense block-FP8 linears: vLLM's AMX kernel failed its known-answer check ({bad.check.message()}); "
        f"serving them dequantized to BF16 at load instead. vLLM defect: {VLLM_AMX_DEFECT}."]
    assert AMX_CODES in warnings[0]


def _vllm_fp8_linear_method(vllm_config):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    with set_current_vllm_config(vllm_config):
        return Fp8LinearMethod(vllm_config.quant_config)


def _force_amx(monkeypatch, amx: bool) -> str:
    """Make vLLM-CPU and vllm-ling see a CPU with or without AMX; returns how. The real
    hardware path is left alone. AMX forced on a CPU without it: vLLM selects its AMX kernel
    (CPUFp8BlockScaledMMKernel) as it would there, and its two ops, which would execute AMX
    instructions, are replaced by an emulation of their e4m3 decode defect
    (faults.amx_e4m3_decode), so the check sees what the real kernel computes (a test on AMX
    hardware runs the real ops and checks they fail the same way)."""
    if amx == HAS_AMX:
        return "real"
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    if not amx:
        return "forced without AMX"
    from vllm.model_executor.kernels.linear.scaled_mm import cpu as vllm_cpu_kernels

    def process_weights_after_loading(self, layer):
        params = self._get_layer_params(layer)
        bn, bk = self.weight_group_shape
        scale = params.weight_scale_inv.data.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        layer.amx_emulated_weight = (faults.amx_e4m3_decode(params.weight.data) * scale).to(torch.bfloat16)

    def apply_weights(self, layer, x, bias=None, **kwargs):
        return torch.nn.functional.linear(x, layer.amx_emulated_weight, bias)

    kernel = vllm_cpu_kernels.CPUFp8BlockScaledMMKernel
    monkeypatch.setattr(vllm_cpu_kernels.ops, "_supports_cpu_fp8_w8a16", True, raising=False)
    monkeypatch.setattr(vllm_cpu_kernels.ops, "cpu_has_amx_fp8", lambda: False)  # the W8A16 kernel, as on SPR
    monkeypatch.setattr(kernel, "process_weights_after_loading", process_weights_after_loading)
    monkeypatch.setattr(kernel, "apply_weights", apply_weights)
    return "forced AMX (kernel ops emulated)"


def _keep_recorded_selections(monkeypatch, layer):
    """Choosing records the selection on the layer: the session's shared model keeps its own."""
    from vllm_ling.selection import SELECTIONS_ATTR

    monkeypatch.setattr(layer, SELECTIONS_ATTR, dict(getattr(layer, SELECTIONS_ATTR, {})))


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_vllms_cpu_kernel_is_caught_or_refused(loaded_tiny_models, monkeypatch, amx):
    """vLLM's own block-FP8 method, as vLLM-CPU selects its kernel: with AMX its kernel runs and
    the check catches the e4m3 defect; without AMX vLLM has no kernel and the check fails naming
    why. This CPU's own path runs for real, the other one is forced (_force_amx). The check runs
    under the vLLM config, as in the server (vLLM's kernel selection reads it)."""
    from vllm.config import set_current_vllm_config

    from vllm_ling.layers.known_answer import check_dense_fp8_method

    vllm_config, _, _ = loaded_tiny_models
    how = _force_amx(monkeypatch, amx)
    with set_current_vllm_config(vllm_config):
        r = check_dense_fp8_method(_vllm_fp8_linear_method(vllm_config))
    assert not r.passed, how
    if amx:
        from vllm import _custom_ops as vllm_ops

        # vLLM prefers its W8A8 kernel on CPUs with AMX-FP8 (Granite Rapids); the defect is
        # known (and emulated) for the W8A16 one that Sapphire Rapids gets
        w8a8 = how == "real" and vllm_ops.cpu_has_amx_fp8()
        assert r.kernel == f"Fp8LinearMethod/CPUFp8{'W8A8' if w8a8 else ''}BlockScaledMMKernel", (how, r.message())
        if not w8a8:
            assert f"wrong e4m3 codes {AMX_CODES}" in r.failing_inputs[0], (how, r.message())
    else:
        assert r.kernel == "Fp8LinearMethod", (how, r.message())
        assert math.isinf(r.max_error) and r.failing_inputs[0].startswith("scratch layer 256x256: raised "), how


def test_the_served_path_is_the_one_this_cpu_takes(loaded_tiny_models):
    """The session's loaded models chose on this CPU's real hardware: dequantized either way,
    after the AMX kernel failed its known answers (AMX) or without running it (no AMX); each
    linear records the choice (no process-wide guess)."""
    from vllm_ling.layers import dense_fp8_path
    from vllm_ling.selection import Feature, recorded

    vllm_config, target, _ = loaded_tiny_models
    path = vllm_config.quant_config._ling_cpu_dense_fp8_path  # decided once per quant config
    assert path is not None and path.kernel == dense_fp8_path.DEQUANTIZED
    selection = recorded(target.model.layers[0].mlp.gate_up_proj, Feature.DENSE_FP8)
    assert (selection.choice, selection.reason) == (path.kernel, path.reason)
    if HAS_AMX:
        assert not path.check.passed and "vLLM's AMX kernel failed its known-answer check" in path.reason
    else:
        assert path.check is None and path.reason == "CPU without AMX: vLLM-CPU has no block-FP8 kernel"


def _keep_recorded_selections(monkeypatch, layer):
    """Choosing records the selection on the layer: the session's shared model keeps its own."""
    from vllm_ling.selection import SELECTIONS_ATTR

    monkeypatch.setattr(layer, SELECTIONS_ATTR, dict(getattr(layer, SELECTIONS_ATTR, {})))


@pytest.mark.parametrize("amx", [True, False], ids=["amx", "no_amx"])
def test_ling_fp8_decides_on_vllms_real_method_and_serves_dequantized(loaded_tiny_models, monkeypatch, amx):
    """The quant config's decision end to end, on vLLM's real Fp8LinearMethod and kernel
    selection, for both CPUs (this one real, the other forced): dequantized BF16 serves, with
    the AMX kernel's failed check as the reason where AMX is present."""
    from vllm.config import set_current_vllm_config

    from vllm_ling.layers import dense_fp8_path
    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod

    vllm_config, target, _ = loaded_tiny_models
    how = _force_amx(monkeypatch, amx)
    monkeypatch.setattr(vllm_config.quant_config, "_ling_cpu_dense_fp8_path", None)
    layer = target.model.layers[0].mlp.gate_up_proj
    _keep_recorded_selections(monkeypatch, layer)
    with set_current_vllm_config(vllm_config):
        method = vllm_config.quant_config.get_quant_method(layer, "model.layers.0.mlp.gate_up_proj")
    path = vllm_config.quant_config._ling_cpu_dense_fp8_path
    assert type(method) is CpuBlockFp8LinearMethod and path.kernel == dense_fp8_path.DEQUANTIZED, how
    if amx:
        assert path.check.kernel.startswith("Fp8LinearMethod/CPUFp8"), how
        assert not path.check.passed and "vLLM's AMX kernel failed its known-answer check" in path.reason, how
    else:
        assert path.check is None and "CPU without AMX" in path.reason, how


@pytest.mark.parametrize("vllm_kernel_correct", [False, True])
def test_ling_fp8_serves_vllms_amx_kernel_only_if_it_passes(loaded_tiny_models, monkeypatch, vllm_kernel_correct):
    """AMX reported present: ling_fp8 runs the known-answer check on vLLM's method (here
    stood in by a correct / an AMX-defect method, since this CPU may lack AMX) before any
    weight loads, and returns vLLM's Fp8LinearMethod only when it passes."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_ling.layers import dense_fp8_path, known_answer
    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod

    vllm_config, target, _ = loaded_tiny_models
    stand_in = (CpuBlockFp8LinearMethod if vllm_kernel_correct else _amx_defect_method_class())([128, 128], True)
    checked = []
    real_check = known_answer.check_dense_fp8_method

    def check(method, *args, **kwargs):
        checked.append(type(method).__name__)
        return real_check(stand_in, *args, **kwargs)

    monkeypatch.setattr(vllm_config.quant_config, "_ling_cpu_dense_fp8_path", None)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(known_answer, "check_dense_fp8_method", check)
    layer = target.model.layers[0].mlp.gate_up_proj
    _keep_recorded_selections(monkeypatch, layer)
    with set_current_vllm_config(vllm_config):
        first = vllm_config.quant_config.get_quant_method(layer, "model.layers.0.mlp.gate_up_proj")
        second = vllm_config.quant_config.get_quant_method(layer, "model.layers.0.mlp.down_proj")
    assert checked == ["Fp8LinearMethod"]  # vLLM's own method is what gets checked, once per quant config
    expected = Fp8LinearMethod if vllm_kernel_correct else CpuBlockFp8LinearMethod
    assert type(first) is expected and type(second) is expected
    from vllm_ling.selection import Feature, recorded

    # the layer records what it serves
    assert recorded(layer, Feature.DENSE_FP8).choice is (dense_fp8_path.VLLM_AMX if vllm_kernel_correct
                                                         else dense_fp8_path.DEQUANTIZED)


@pytest.mark.parametrize("ue8m0", [False, True])
def test_a_correct_w8a8_kernel_passes_whatever_it_says_about_input_quantization(monkeypatch, ue8m0):
    # vLLM's W8A8 block-FP8 kernels round the activations to e4m3 per 128 inputs: DeepGEMM (UE8M0
    # scales by default) and CUTLASS say apply_input_quant = True; FlashInfer's (picked first on
    # sm_90 with FlashInfer and DeepGEMM) says False because it takes BF16 and quantizes inside.
    # A correct one must pass, with the tight tolerance (the random row is exact in FP8). The
    # kernels need a GPU: a plain-PyTorch stand-in that rounds activations as they do.
    from vllm.model_executor.kernels.linear.scaled_mm.flashinfer import (
        FlashInferFp8DeepGEMMDynamicBlockScaledKernel)
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod
    from vllm.model_executor import utils as vllm_utils

    from vllm_ling.layers.known_answer import check_dense_fp8_method
    from vllm_ling.ops.fp8 import block_fp8_dequantize

    def create_weights(self, layer, k_part, sizes, k, n, dtype, **extra):
        layer.weight = torch.nn.Parameter(torch.empty(sum(sizes), k_part, dtype=torch.float8_e4m3fn),
                                          requires_grad=False)
        layer.weight_scale_inv = torch.nn.Parameter(torch.empty(sum(sizes) // 128, k_part // 128),
                                                    requires_grad=False)
        self.fp8_linear = object.__new__(FlashInferFp8DeepGEMMDynamicBlockScaledKernel)

    def apply(self, layer, x, bias=None):  # e4m3 activations, one scale per 128 inputs
        groups = x.float().reshape(x.shape[0], -1, 128)
        scale = groups.abs().amax(-1, keepdim=True).clamp_min(1e-12) / 448.0
        if ue8m0:
            scale = torch.exp2(torch.ceil(torch.log2(scale)))
        xq = ((groups / scale).to(torch.float8_e4m3fn).float() * scale).reshape(x.shape)
        w = block_fp8_dequantize(layer.weight.data, layer.weight_scale_inv.data, (128, 128), dtype=torch.float32)
        return (xq @ w.t()).to(x.dtype)

    monkeypatch.setattr(vllm_utils, "is_weights_pre_processed", lambda: False)
    monkeypatch.setattr(Fp8LinearMethod, "create_weights", create_weights)
    monkeypatch.setattr(Fp8LinearMethod, "process_weights_after_loading", lambda self, layer: None)
    monkeypatch.setattr(Fp8LinearMethod, "apply", apply)
    method = object.__new__(Fp8LinearMethod)
    method.weight_block_size = [128, 128]
    result = check_dense_fp8_method(method)
    assert result.passed and result.cases == 2, result.message()
    assert result.kernel == "Fp8LinearMethod/FlashInferFp8DeepGEMMDynamicBlockScaledKernel"
