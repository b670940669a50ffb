"""Startup known-answer checks on the loaded tiny models: they find the kernels that really
serve (from the census: the attached quant methods), pass on them, and fail naming kernel, inputs
and max error when a serving kernel computes wrong numbers (planted faults)."""

from __future__ import annotations

import known_answer_faults as faults  # tests/known_answer_faults.py
import pytest
import torch

pytest.importorskip("vllm")

MOE_REF = "plain-PyTorch MXFP4 reference (CPU platform)"


def _census(models):
    from vllm_ling.layers.readers import readers
    from vllm_ling.runtime.verification.census import take_census

    _, target, draft = models
    return take_census(target, draft, readers())


def test_checks_find_and_pass_every_serving_kernel(loaded_tiny_models):
    from vllm_ling.runtime.verification.known_answers import (KDA_CPU_KERNEL, dense_fp8_kernels, run_kernel_checks,
                                                              summary)

    _, target, draft = loaded_tiny_models
    census = _census(loaded_tiny_models)
    results = run_kernel_checks(census)
    assert [(r.name, r.kernel, r.passed) for r in results] == [
        ("dense_fp8", "CpuBlockFp8LinearMethod", True), ("moe_mxfp4", MOE_REF, True),
        ("fp8_head", "torch", True), ("kda", KDA_CPU_KERNEL, True)], [r.message() for r in results]
    assert summary(results) == (True, "4 kernel(s) match their known answers: dense_fp8 [CpuBlockFp8LinearMethod], "
                                      f"moe_mxfp4 [{MOE_REF}], fp8_head [torch], kda [{KDA_CPU_KERNEL}]")
    # What serves, read from the modules: every block-FP8 linear of target and draft.
    from vllm.model_executor.layers.linear import LinearBase

    n = sum(1 for model in (target, draft) for m in model.modules()
            if isinstance(m, LinearBase) and hasattr(m, "weight_block_size") and m.weight_block_size)
    assert dense_fp8_kernels(census) == {"CpuBlockFp8LinearMethod": n} and n > 0


def test_planted_faults_in_serving_kernels_are_named(loaded_tiny_models, monkeypatch):
    """A dense method with the AMX e4m3 defect, an MoE method reading nibbles swapped, a head
    kernel reading code 0 as 2^-7 and a KDA decode losing the state: each check fails and
    the summary names all four."""
    from vllm.model_executor.utils import replace_parameter

    from vllm_ling.layers import fp8_lm_head
    from vllm_ling.layers.dense_fp8_cpu import CpuBlockFp8LinearMethod
    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod
    from vllm_ling.runtime.verification.known_answers import run_kernel_checks, summary

    def amx_defect(self, layer):  # only scratch layers are processed after loading
        bn, bk = self.weight_block_size
        s = layer.weight_scale_inv.data.float().repeat_interleave(bn, 0).repeat_interleave(bk, 1)
        replace_parameter(layer, "weight", (faults.amx_e4m3_decode(layer.weight.data) * s).to(layer.orig_dtype))

    original_apply = LingMxfp4MoEMethod.apply

    def nibbles_swapped(self, layer, x, *args):
        swapped = type("L", (), {**vars(layer), "w13_weight": faults.swap_nibbles(layer.w13_weight)})
        return original_apply(self, swapped, x, *args)

    original_logits = fp8_lm_head.head_ops.fp8_head_logits

    def zero_code_fault(x, state):
        import dataclasses

        return original_logits(x, dataclasses.replace(state, weight=faults.plant_zero_code_fault(state.weight)))

    from vllm_ling.layers import kda_cpu

    def decode_from_zero_state(q, k, v, g, beta, pool, *rest):
        return original_decode(q, k, v, g, beta, torch.zeros_like(pool), *rest)

    original_decode = kda_cpu.kda_ops.kda_decode_pooled
    monkeypatch.setattr(kda_cpu.kda_ops, "kda_decode_pooled", decode_from_zero_state)
    monkeypatch.setattr(CpuBlockFp8LinearMethod, "process_weights_after_loading", amx_defect)
    monkeypatch.setattr(LingMxfp4MoEMethod, "apply", nibbles_swapped)
    monkeypatch.setattr(fp8_lm_head.head_ops, "fp8_head_logits", zero_code_fault)
    results = run_kernel_checks(_census(loaded_tiny_models))
    assert [r.passed for r in results] == [False, False, False, False]
    dense, moe, head, kda = results
    assert kda.failing_inputs == ["1 decode token per sequence (from the prefill's states): 2 of 2 outputs"]
    assert dense.failing_inputs == ["256 one-hot rows (GEMM-sized): wrong e4m3 codes 0x00-0x07 0x80-0x87 in "
                                    "blocks [0,0] x2^0, [0,1] x2^0 (all-zero), [1,0] x2^-24, [1,1] x2^16"]
    assert [f.split(":")[0] for f in moe.failing_inputs] == ["4 tokens (decode-sized), no clamp",
                                                            "4 tokens (decode-sized), SwiGLU clamp 7",
                                                            "4 tokens (decode-sized), SwiGLU clamp 1 after the SiLU"]
    assert head.failing_inputs == ["256 one-hot rows (GEMM-sized): wrong e4m3 codes 0x00 0x80 in 256 rows "
                                   "(scales 2^-20..7168)"]
    ok, line = summary(results)
    assert not ok and line == " | ".join(r.message() for r in results)
    assert line.startswith("dense_fp8 [CpuBlockFp8LinearMethod]: max relative error 32 > tolerance 0.00781 on ")
    # the loaded layers still compute right: the checks ran on scratch copies
    monkeypatch.undo()
    assert all(r.passed for r in run_kernel_checks(_census(loaded_tiny_models)))


def test_a_check_that_raises_while_preparing_fails_alone_named_with_its_place(loaded_tiny_models, monkeypatch):
    """The first GPU run of the router top-k check raised a bare StopIteration while building its problem,
    and the whole row read "finding the serving kernels: raised StopIteration: " with no kernel checked.
    Now that check fails alone, naming its kernel and where it raised, and the others still run."""
    from vllm_ling.layers import known_answer as layer_checks
    from vllm_ling.runtime.verification.known_answers import run_kernel_checks

    def no_decoy_group(method, device="cpu"):
        return next(g for g in range(2) if g > 1)  # as the decoy search did for two groups keeping one

    monkeypatch.setattr(layer_checks, "check_moe_method", no_decoy_group)
    results = run_kernel_checks(_census(loaded_tiny_models))
    assert [(r.name, r.passed) for r in results] == [("dense_fp8", True), ("moe_mxfp4", False), ("fp8_head", True),
                                                     ("kda", True)]
    [why] = results[1].failing_inputs
    assert why.startswith("preparing the check raised StopIteration: ") and "in no_decoy_group" in why
    assert "LingMxfp4MoEMethod" in results[1].kernel


def test_vllms_own_moe_method_is_named_unchecked_with_its_other_swiglu_clamp(loaded_tiny_models, monkeypatch):
    """Issue 43: a routed-expert layer served by vLLM's own MoE method (the upstream composition)
    has no known-answer runner; its row in the report and the startup table says why its logits
    differ from ours: vLLM 0.32 clamps the routed SwiGLU gate before the SiLU, vllm-ling after."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.fused_moe import RoutedExperts
    from vllm.model_executor.layers.fused_moe.unquantized_fused_moe_method import UnquantizedFusedMoEMethod

    from vllm_ling.runtime.verification.formatting import known_answer_lines
    from vllm_ling.runtime.verification.known_answers import VLLM_MOE_UNCHECKED, report_section

    vllm_config, target, draft = loaded_tiny_models
    layer = next(m for m in draft.modules() if isinstance(m, RoutedExperts))
    store = layer._modules if "quant_method" in layer._modules else layer.__dict__  # a module or a plain object
    with set_current_vllm_config(vllm_config):
        monkeypatch.setitem(store, "quant_method", UnquantizedFusedMoEMethod(layer.moe_config))
    section = report_section(_census(loaded_tiny_models))
    (row,) = [r for r in section["results"] if r["kernel"] == "vllm:UnquantizedFusedMoEMethod"]
    assert row["skipped"] == VLLM_MOE_UNCHECKED and section["passed"]
    assert ("clamp the SwiGLU gate before the SiLU, silu(min(g, L)) * clamp(u, -L, L) (vLLM 0.32); "
            "vllm-ling clamps after the SiLU, min(silu(g), L) * clamp(u, -L, L)") in row["skipped"]
    assert any(line.strip() == f"moe_mxfp4 [vllm:UnquantizedFusedMoEMethod]: not checked: {VLLM_MOE_UNCHECKED}"
               for line in known_answer_lines(section))
