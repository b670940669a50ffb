"""The residual norm decision (vllm_ling.runtime.residual_norm): vllm-ling's provider first in vLLM's IR op
priority on CUDA, the user's list and the opt-out respected, nothing on CPU; the worker's check against what
its dispatcher holds; the report entry confirmed by the kernel's calls after warm-up; the provider registered
with vLLM's IR op under the schema vLLM requires."""

from __future__ import annotations

import logging
import types

import pytest

from vllm_ling.options import LingOptions
from vllm_ling.runtime import residual_norm as R
from vllm_ling.runtime.verification import residual_norm as V


def _config(priority=None, hidden=4096, dtype=None):
    import torch
    from vllm.config.kernel import IrOpPriorityConfig

    ir_priority = IrOpPriorityConfig() if priority is None else IrOpPriorityConfig(fused_add_rms_norm=priority)
    hf = types.SimpleNamespace(hidden_size=hidden, rms_norm_eps=1e-6)
    return types.SimpleNamespace(kernel_config=types.SimpleNamespace(ir_op_priority=ir_priority),
                                 model_config=types.SimpleNamespace(hf_config=hf, dtype=dtype or torch.bfloat16),
                                 compilation_config=types.SimpleNamespace(inductor_compile_config={}))


def _options(value="ling"):
    return LingOptions.from_env({"VLLM_LING_RESIDUAL_NORM": value})


def _available():
    return None


def test_cuda_puts_the_provider_first_and_vllm_appends_its_defaults_after_it():
    from vllm.config.kernel import IrOpPriorityConfig

    config = _config()
    selection = R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    assert selection.choice is R.NormPath.LING
    assert config.kernel_config.ir_op_priority.fused_add_rms_norm == [R.PROVIDER]
    # what KernelConfig.set_platform_defaults then does with CUDA's defaults under Inductor
    platform = IrOpPriorityConfig.with_default(["native"])
    current = config.kernel_config.ir_op_priority.fused_add_rms_norm
    current.extend(p for p in platform.fused_add_rms_norm if p not in current)
    assert current == [R.PROVIDER, "native"]
    assert R.recorded_residual_norm(config.model_config.hf_config) == selection
    # a second build of the same config keeps the decision (the list is no longer empty, and not the user's)
    again = R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    assert again == selection and current == [R.PROVIDER, "native"]


def test_the_provider_brings_the_moe_sum_fold_into_vllms_post_grad_slot(caplog):
    from vllm_ling.layers.moe_sum_norm import MoeSumNormPass

    config = _config()
    selection = R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    assert isinstance(config.compilation_config.inductor_compile_config[R.FOLD_PASS_KEY], MoeSumNormPass)
    assert R.FOLDED in selection.reason
    # another pass in the slot stays; the fold is said to be off, once, with why
    held = _config()
    theirs = object()
    held.compilation_config.inductor_compile_config[R.FOLD_PASS_KEY] = theirs
    with caplog.at_level(logging.WARNING):
        selection = R.decide_residual_norm(held, _options(), on_cuda=True, unavailable_reason=_available)
    assert held.compilation_config.inductor_compile_config[R.FOLD_PASS_KEY] is theirs
    assert "not folded" in selection.reason and "object" in selection.reason
    assert any("stays an Inductor kernel" in r.getMessage() for r in caplog.records)


def test_the_fold_is_meant_only_where_vllm_compiles_with_the_pass_the_hook_installed():
    from vllm.config import CompilationMode

    from vllm_ling.layers.moe_sum_norm import MoeSumNormPass

    def config(mode, held):
        return types.SimpleNamespace(mode=mode, inductor_compile_config={} if held is None else {R.FOLD_PASS_KEY: held})

    assert R.sum_fold_state(config(CompilationMode.VLLM_COMPILE, MoeSumNormPass())) == (True, "")
    meant, why = R.sum_fold_state(config(CompilationMode.NONE, MoeSumNormPass()))  # --enforce-eager: no pass runs
    assert not meant and "not compiled" in why
    assert not R.sum_fold_state(config(CompilationMode.VLLM_COMPILE, None))[0]  # opted out, CPU, the user's priority
    meant, why = R.sum_fold_state(config(CompilationMode.VLLM_COMPILE, object()))  # another pass in the slot
    assert meant and "holds object" in why


def test_the_fold_entry_says_what_the_compiled_model_folded(caplog):
    served = {"requested": True, "active": True, "detail": "d"}
    entry = V.moe_sum_fold_entry(served, 78, True, "")
    assert entry["requested"] and entry["active"] and "78 norm call(s)" in entry["detail"]
    with caplog.at_level(logging.WARNING):
        none = V.moe_sum_fold_entry(served, 0, True, "")
    assert none["requested"] and not none["active"] and "folded no MoE sum" in none["detail"]
    assert any("folded no MoE sum" in r.getMessage() for r in caplog.records)
    held = V.moe_sum_fold_entry(served, 0, True, "post_grad_custom_post_pass holds X")
    assert held["requested"] and not held["active"] and "holds X" in held["detail"]
    eager = V.moe_sum_fold_entry(served, 0, False, "the model is not compiled by vLLM")
    assert not eager["requested"] and not eager["active"] and "not compiled" in eager["detail"]
    off = V.moe_sum_fold_entry({"requested": False, "active": False, "detail": "x"}, 0, True, "")
    assert not off["requested"] and "does not serve" in off["detail"]


def test_the_users_priority_wins():
    config = _config(["vllm_c", "native"])
    selection = R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    assert selection.choice is R.NormPath.USER and "vllm_c,native" in selection.reason
    assert config.kernel_config.ir_op_priority.fused_add_rms_norm == ["vllm_c", "native"]


def test_opt_out_keeps_vllms_default_with_one_warning(caplog):
    config = _config()
    with caplog.at_level(logging.WARNING):
        selection = R.decide_residual_norm(config, _options("vllm"), on_cuda=True, unavailable_reason=_available)
    assert selection.choice is R.NormPath.OPTED_OUT and "VLLM_LING_RESIDUAL_NORM=vllm" in selection.reason
    assert config.kernel_config.ir_op_priority.fused_add_rms_norm == []
    assert any("Residual norms stay vLLM's" in r.getMessage() for r in caplog.records)
    assert R.FOLD_PASS_KEY not in config.compilation_config.inductor_compile_config  # nor the MoE-sum fold


def test_cpu_asks_for_nothing():
    config = _config()
    selection = R.decide_residual_norm(config, _options(), on_cuda=False, unavailable_reason=_available)
    assert selection.choice is R.NormPath.NOT_CUDA
    assert config.kernel_config.ir_op_priority.fused_add_rms_norm == []


@pytest.mark.parametrize("hidden,dtype,says", [(4100, "bfloat16", "hidden size 4100"),
                                               (4096, "float16", "needs BF16 rows")])
def test_rows_the_kernel_does_not_take_are_an_explicit_fallback(caplog, hidden, dtype, says):
    import torch

    from vllm_ling.runtime.verification.checks import Check

    config = _config(hidden=hidden, dtype=getattr(torch, dtype))
    with caplog.at_level(logging.WARNING):
        selection = R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    assert selection.choice is R.NormPath.ROWS and says in selection.reason
    assert config.kernel_config.ir_op_priority.fused_add_rms_norm == []  # vLLM's default follows
    assert [r for r in caplog.records if "Residual norms stay vLLM's" in r.getMessage()]
    entry = V.residual_norm_entry(config, Check(V.CHECK_NAME, True, "e", "a"))
    assert entry["requested"] and not entry["active"] and entry["detail"].startswith("fallback: ")


def test_a_kernel_that_cannot_run_is_refused_naming_the_opt_out():
    from vllm_ling.refusal import Refusal

    config = _config()
    with pytest.raises(R.ResidualNormUnavailable, match="VLLM_LING_RESIDUAL_NORM=vllm") as err:
        R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=lambda: "no NVRTC")
    assert isinstance(err.value, Refusal) and "no NVRTC" in str(err.value)
    assert config.kernel_config.ir_op_priority.fused_add_rms_norm == []


def test_the_provider_is_registered_with_vllms_op_under_one_name():
    from vllm import ir

    from vllm_ling.layers import residual_norm as layer

    layer.register_residual_norm()
    assert layer.register_residual_norm() == []  # idempotent
    assert layer.registered()
    impl = ir.ops.fused_add_rms_norm.impls[R.PROVIDER]
    assert not impl.supported  # the CPU platform: never listed here


def test_the_provider_takes_only_what_the_kernel_computes():
    import torch

    from vllm_ling.layers.residual_norm import supports_args

    meta = dict(device="meta")
    x = torch.empty(3, 4096, dtype=torch.bfloat16, **meta)
    w = torch.empty(4096, dtype=torch.bfloat16, **meta)
    assert not supports_args(x, x, w, 1e-6)  # not CUDA
    cuda_like = types.SimpleNamespace(is_cuda=True, dim=lambda: 2, shape=(3, 4096), dtype=torch.bfloat16)
    assert supports_args(cuda_like, cuda_like, w, 1e-6)
    assert not supports_args(cuda_like, cuda_like, w, 1e-6, 2048)  # a partial-row variance
    assert not supports_args(cuda_like, cuda_like, None, 1e-6)  # no weight
    odd = types.SimpleNamespace(is_cuda=True, dim=lambda: 2, shape=(3, 4100), dtype=torch.bfloat16)
    assert not supports_args(odd, odd, torch.empty(4100, dtype=torch.bfloat16, **meta), 1e-6)
    fp16 = types.SimpleNamespace(is_cuda=True, dim=lambda: 2, shape=(3, 4096), dtype=torch.float16)
    assert not supports_args(fp16, fp16, torch.empty(4096, dtype=torch.float16, **meta), 1e-6)


def _check_with(config, in_force, monkeypatch):
    monkeypatch.setattr(V, "priority_in_force", lambda: list(in_force))
    return V.check_residual_norm(config)


def test_check_passes_where_the_worker_holds_what_was_decided(monkeypatch):
    config = _config()
    R.decide_residual_norm(config, _options("vllm"), on_cuda=True, unavailable_reason=_available)
    assert _check_with(config, ["native"], monkeypatch).passed
    # the provider in force although the decision kept vLLM's: a divergence
    row = _check_with(config, [R.PROVIDER, "native"], monkeypatch)
    assert not row.passed and "VLLM_LING_RESIDUAL_NORM" in row.fix


def test_check_fails_where_the_provider_was_decided_and_the_worker_holds_another_list(monkeypatch):
    config = _config()
    R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    row = _check_with(config, ["native"], monkeypatch)
    assert not row.passed and "priority native" in row.actual


def test_check_runs_the_known_answers_where_the_provider_is_first(monkeypatch):
    config = _config()
    R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    seen = []

    def known(hidden, eps, device):
        seen.append((hidden, eps))
        return False, "1 token(s): normalised rows off by up to 0.5"

    monkeypatch.setattr(V, "known_answers", known)
    monkeypatch.setattr(V, "priority_in_force", lambda: [R.PROVIDER, "native"])
    row = V.check_residual_norm(config, device="cuda:0")
    assert seen == [(4096, 1e-6)]
    assert not row.passed and "off by up to 0.5" in row.actual and "report it" in row.fix


def test_check_fails_without_a_recorded_decision(monkeypatch):
    row = _check_with(_config(), ["native"], monkeypatch)
    assert not row.passed and "config hook" in row.fix


def test_entry_requested_where_decided_and_confirmed_by_the_calls(caplog):
    from vllm_ling.runtime.verification.checks import Check

    config = _config()
    R.decide_residual_norm(config, _options(), on_cuda=True, unavailable_reason=_available)
    entry = V.residual_norm_entry(config, Check(V.CHECK_NAME, True, "e", "a"))
    assert entry["requested"] and entry["active"]
    assert V.confirm_calls(entry, 80)["active"]
    with caplog.at_level(logging.WARNING):
        unserved = V.confirm_calls(entry, 0)
    assert not unserved["active"] and "never called" in unserved["detail"]
    assert any("not served" in r.getMessage() for r in caplog.records)
    off = _config()
    R.decide_residual_norm(off, _options("vllm"), on_cuda=True, unavailable_reason=_available)
    off_entry = V.residual_norm_entry(off, Check(V.CHECK_NAME, True, "e", "a"))
    assert not off_entry["requested"] and not off_entry["active"]
    assert V.confirm_calls(off_entry, 0) == off_entry


def test_reference_matches_vllms_native_op():
    """The plain-PyTorch reference the kernel is held to computes what vLLM's native op computes (CPU)."""
    import torch
    from vllm import ir

    from vllm_ling.ops.residual_norm.reference import add_rms_norm

    g = torch.Generator().manual_seed(0)
    x = (4 * torch.randn(5, 512, generator=g)).bfloat16()
    residual = torch.randn(5, 512, generator=g).bfloat16()
    weight = (1 + 0.1 * torch.randn(512, generator=g)).bfloat16()
    want = ir.ops.fused_add_rms_norm.impls["native"].impl_fn(x.clone(), residual.clone(), weight, 1e-6)
    got = add_rms_norm(x, residual, weight, 1e-6)
    assert torch.equal(got[1], want[1]) and torch.equal(got[0], want[0])
    # and a different input gives a different answer (the comparison can fail)
    assert not torch.equal(add_rms_norm(x, residual * 2, weight, 1e-6)[0], want[0])


@pytest.mark.parametrize("hidden,layout", [(4096, (512, 1)), (256, (32, 1)), (8192, (1024, 1)),
                                           (12288, (768, 2)), (32768, (1024, 4)), (4100, None), (100, None),
                                           (65536, None)])
def test_kernel_layout(hidden, layout):
    from vllm_ling.ops.residual_norm.kernel import layout as kernel_layout

    assert kernel_layout(hidden) == layout
    if layout:
        threads, chunks = layout
        assert threads * chunks * 8 == hidden and threads % 32 == 0


def test_the_kernels_answers_are_held_to_the_reference_within_two_bf16_steps():
    """The comparison the known answers and the warm-up use (vllm_ling.ops.residual_norm.reference.mismatch)."""
    import torch

    from vllm_ling.ops.residual_norm.reference import add_rms_norm, mismatch

    g = torch.Generator().manual_seed(1)
    x, residual = (torch.randn(3, 256, generator=g).bfloat16() for _ in range(2))
    weight = torch.ones(256).bfloat16()
    want = add_rms_norm(x, residual, weight, 1e-6)
    assert mismatch(want, want) is None
    # the intermediate rounding flipped by one step and the product's by another (lease 2026-12-07h): held
    two_steps = (want[0].float() * (1 + 2.0 ** -7)).bfloat16()
    assert mismatch((two_steps, want[1]), want) is None
    # four steps and more are not: an eps, weight or row gone wrong is far beyond
    assert mismatch(((want[0].float() * (1 + 2.0 ** -5)).bfloat16(), want[1]), want) is not None
    assert mismatch((want[0] * 1.1, want[1]), want).startswith("normalised rows off by up to")
    assert mismatch((want[0], want[1] + 1), want) == "wrong residual"
