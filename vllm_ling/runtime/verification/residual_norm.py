"""The residual-norm family: the IR op priority this worker's dispatcher holds is the one the config hook
recorded (:mod:`vllm_ling.runtime.residual_norm`), and where vllm-ling's kernel is asked for, the dispatcher
picks it for the model's own rows and it computes the known answers; the report's ``residual_norm`` entry.
After warm-up the worker counts the kernel's calls (:func:`confirm_calls`)."""

from __future__ import annotations

from typing import Any

import torch

from vllm_ling.log import get_logger
from vllm_ling.options import opt_out_setting
from vllm_ling.runtime.residual_norm import FALLBACK, OPTION, PROVIDER, SERVING, NormPath, priority_in_force, \
    recorded_residual_norm
from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.optimizations import config_decision_entry

CHECK_NAME = "residual_norm"
KNOWN_TOKENS = (1, 4, 67)  # a decode token, the verify window, a prefill-sized grid of CTAs
logger = get_logger("verify")


def known_answers(hidden: int, eps: float, device: torch.device) -> tuple[bool, str]:
    """Run vLLM's IR op on known rows through its dispatcher: whether it picked ``vllm_ling`` and matched the
    plain-PyTorch reference at every size of :data:`KNOWN_TOKENS`, with one addend and with two (the MoE sum
    folded in: :mod:`vllm_ling.layers.moe_sum_norm`); the detail says which did not."""
    from vllm import ir

    from vllm_ling.ops.residual_norm.kernel import add_rms_norm_cuda
    from vllm_ling.ops.residual_norm.reference import add2_rms_norm, add_rms_norm, mismatch

    gen = torch.Generator(device="cpu").manual_seed(0)
    weight = (1 + 0.1 * torch.randn(hidden, generator=gen)).to(torch.bfloat16).to(device)
    problems = []
    for tokens in KNOWN_TOKENS:
        x = (4 * torch.randn(tokens, hidden, generator=gen)).to(torch.bfloat16).to(device)
        residual = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
        impl = ir.ops.fused_add_rms_norm.dispatch(x, residual, weight, eps)
        if impl.provider != PROVIDER:
            problems.append(f"{tokens} token(s): the dispatcher picked {impl.provider}")
            continue
        # the provider's kernel itself (uncounted: the call count says whether the model called it)
        wrong = mismatch(add_rms_norm_cuda(x, residual, weight, eps), add_rms_norm(x, residual, weight, eps))
        if wrong:
            problems.append(f"{tokens} token(s): {wrong}")
        x2 = torch.randn(tokens, hidden, generator=gen).to(torch.bfloat16).to(device)
        wrong = mismatch(add_rms_norm_cuda(x, residual, weight, eps, x2=x2),
                         add2_rms_norm(x, x2, residual, weight, eps))
        if wrong:
            problems.append(f"{tokens} token(s) with two addends: {wrong}")
    if problems:
        return False, "; ".join(problems)
    return True, f"known answers at {'/'.join(map(str, KNOWN_TOKENS))} tokens x {hidden}, one and two addends"


def check_residual_norm(vllm_config, device: torch.device | None = None) -> Check:
    """The recorded decision against the priority this worker installed, and where the kernel serves, the
    dispatcher's pick and the known answers at the model's hidden size."""
    hf = vllm_config.model_config.hf_config
    recorded = recorded_residual_norm(hf)
    in_force = priority_in_force()
    actual = f"IR op fused_add_rms_norm priority {','.join(in_force) or '(none)'}"
    if recorded is None:
        return Check(CHECK_NAME, False, "a decision recorded by the config hook (P4)", actual,
                     "the config hook did not run for this model: check `vllm_ling.patches.registry`")
    expected = f"{recorded.choice}: {recorded.reason}"
    fix = ("something changed vLLM's ir_op_priority after vllm-ling set it: give `--ir-op-priority` yourself, or "
           f"{opt_out_setting(OPTION)}")
    if recorded.choice is NormPath.USER:
        return Check(CHECK_NAME, True, expected, actual)
    if recorded.choice not in SERVING:
        return Check(CHECK_NAME, PROVIDER not in in_force, expected, actual, fix)
    if in_force[:1] != [PROVIDER]:
        return Check(CHECK_NAME, False, expected, actual, fix)
    device = device or torch.device("cuda", torch.cuda.current_device())
    passed, detail = known_answers(int(hf.hidden_size), float(hf.rms_norm_eps), device)
    return Check(CHECK_NAME, passed, expected, f"{actual}; {detail}",
                 "" if passed else f"the residual norm kernel computes wrong: {opt_out_setting(OPTION)} and report it")


def residual_norm_entry(vllm_config, row: Check) -> dict[str, Any]:
    """Requested where the kernel was put first, or where it does not take the model's rows (a fallback:
    inactive); active where it was put first and the row passed (and, after warm-up, the compiled model called
    the kernel: :func:`confirm_calls`)."""
    return config_decision_entry(recorded_residual_norm(vllm_config.model_config.hf_config), SERVING, FALLBACK, row)


def confirm_calls(entry: dict[str, Any], calls: int) -> dict[str, Any]:
    """The report entry once the model ran (profile run, warm-up, CUDA graph capture): active only where the
    kernel was called (the known answers launch the kernel itself and do not count). One WARNING where it was
    not; an entry not active is left as it is."""
    if not entry.get("active"):
        return entry
    if calls > 0:
        return {**entry, "detail": f"{entry['detail']}; {calls} call(s) by the model before serving"}
    why = "the compiled model never called it (vLLM's lowering picked another provider)"
    logger.warning("The residual norm kernel is first in the IR op priority but not served: %s.", why)
    return {**entry, "active": False, "detail": f"{entry['detail']}; not in force: {why}"}


def moe_sum_fold_entry(norm: dict[str, Any], folded: int, meant: bool, why_not: str) -> dict[str, Any]:
    """The report entry ``moe_sum_fold`` once the model ran (:mod:`vllm_ling.layers.moe_sum_norm`): requested
    where the residual norm kernel serves a model vLLM compiled with the fold meant (``meant``, ``why_not``:
    :func:`vllm_ling.runtime.residual_norm.sum_fold_state`); active where norms took the MoE sum in
    (``folded`` calls). A compiled model that folded none: one WARNING (each norm then waits for the sum's own
    kernel); another pass in vLLM's slot was said at the config hook."""
    if not norm.get("active") or not meant:
        why = "the residual norm kernel does not serve" if not norm.get("active") else why_not
        return {"requested": False, "active": False, "detail": f"not selected: {why}"}
    if why_not:
        return {"requested": True, "active": False, "detail": f"fallback: {why_not}"}
    if folded > 0:
        return {"requested": True, "active": True, "detail": f"{folded} norm call(s) took the MoE sum in before serving"}
    why = "the compiled model folded no MoE sum (the pass found no shared + routed add before a norm)"
    logger.warning("The residual norm kernel serves, but %s: each norm waits for the sum's own kernel.", why)
    return {"requested": True, "active": False, "detail": f"fallback: {why}"}
