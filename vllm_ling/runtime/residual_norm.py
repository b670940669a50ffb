"""Which implementation computes the decoder layers' residual add + RMSNorm: vLLM's IR op priority for
``fused_add_rms_norm``, decided by the config hook (P4) before the engine starts.

Why: the decode step runs about 80 of these norms, each an Inductor reduction of 2-4.7 us that the next
kernel waits for in full before it launches (benchmarks/results/gpu_serving_h200.md);
:mod:`vllm_ling.layers.residual_norm` registers vllm-ling's kernel as the IR op's provider ``vllm_ling``,
after which the next kernel launches at once and streams its weights while the norm runs.

vLLM fills ``kernel_config.ir_op_priority`` with its platform defaults after the config hooks, and appends
them to a list the user gave; every worker installs the list at start. The hook puts ``vllm_ling`` first
where the list is still empty (the user's list wins) and records the decision on the target's hf_config,
which reaches every worker; the startup verification compares the priority each worker's dispatcher holds
with the record and runs the IR op on known answers (:mod:`vllm_ling.runtime.verification.residual_norm`).
"""

from __future__ import annotations

import logging

from vllm_ling.layers.residual_norm import PROVIDER
from vllm_ling.log import get_logger, log_once
from vllm_ling.options import Choice, LingOptions, ResidualNorm, opt_out_setting
from vllm_ling.refusal import Refusal
from vllm_ling.selection import Feature, Selection, record_on_config, recorded_on_config

logger = get_logger("config")

RESIDUAL_NORM_ATTR = "vllm_ling_residual_norm"
OPTION = "VLLM_LING_RESIDUAL_NORM"
IR_OP = "fused_add_rms_norm"
FOLD_PASS_KEY = "post_grad_custom_post_pass"  # vLLM's one slot for a plugin's post-grad pass
FOLDED = "the MoE sum folded in by a post-grad pass"


class NormPath(Choice):
    LING = "ling"          # vllm-ling's kernel first in the priority list
    OPTED_OUT = "vllm"     # VLLM_LING_RESIDUAL_NORM=vllm: vLLM's platform default
    USER = "user"          # the user's --ir-op-priority list: as given
    NOT_CUDA = "not_cuda"  # the kernel is CUDA's: vLLM's platform default
    ROWS = "rows"          # a fallback: the kernel does not take the model's rows (width, dtype): vLLM's default


SERVING = frozenset((NormPath.LING,))
FALLBACK = frozenset((NormPath.ROWS,))  # asked for (the default) and not served


class ResidualNormUnavailable(Refusal, RuntimeError):
    """The kernel was requested (the default) on CUDA and cannot be compiled or launched in this process."""


def decide_residual_norm(vllm_config, options: LingOptions | None = None, on_cuda: bool | None = None,
                         unavailable_reason=None) -> Selection:
    """Decide, apply to ``vllm_config.kernel_config.ir_op_priority`` and record on the target's hf_config.
    Raises :class:`ResidualNormUnavailable` where the kernel is asked for on CUDA and cannot run here."""
    options = options or LingOptions.current()
    if on_cuda is None:
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda()
    priority = getattr(vllm_config.kernel_config.ir_op_priority, IR_OP)
    hf = vllm_config.model_config.hf_config
    earlier = recorded_residual_norm(hf)
    if earlier is not None and (earlier.choice is not NormPath.LING or priority[:1] == [PROVIDER]):
        return earlier  # a second build of the same config: its decision stands

    def decided(choice: NormPath, reason: str) -> Selection:
        return Selection(Feature.RESIDUAL_NORM, choice, reason)

    if not on_cuda:
        selection = decided(NormPath.NOT_CUDA, "the kernel is CUDA's: vLLM's platform default")
    elif priority:
        selection = decided(NormPath.USER, f"--ir-op-priority {IR_OP}={','.join(priority)}")
    elif options.residual_norm is ResidualNorm.VLLM:
        selection = decided(NormPath.OPTED_OUT, f"opted out ({opt_out_setting(OPTION)})")
        log_once(logger, logging.WARNING, "residual-norm-off",
                 "Residual norms stay vLLM's (%s): each norm of the decode step finishes before the next "
                 "kernel launches; the startup report marks residual_norm inactive.", selection.reason)
    elif rows_problems := _rows_problems(vllm_config.model_config):
        selection = decided(NormPath.ROWS, "; ".join(rows_problems))
        log_once(logger, logging.WARNING, f"residual-norm-rows-{selection.reason}",
                 "Residual norms stay vLLM's: vllm-ling's kernel does not take this model's rows (%s); the startup "
                 "report marks residual_norm requested and inactive.", selection.reason)
    else:
        if unavailable_reason is None:  # the compiler and launcher only: no CUDA call in the engine's parent
            from vllm_ling.ops.cuda_jit import jit_unavailable_reason as unavailable_reason
        why = unavailable_reason()
        if why:
            raise ResidualNormUnavailable(f"the residual norm kernel cannot run here: {why}; opt out with "
                                          f"{opt_out_setting(OPTION)}")
        priority.append(PROVIDER)  # vLLM appends its platform defaults after it
        selection = decided(NormPath.LING, f"provider {PROVIDER} first for vLLM's IR op {IR_OP}; "
                                           f"{_install_sum_fold(vllm_config.compilation_config)}")
        log_once(logger, logging.INFO, "residual-norm", "Residual add + RMSNorm: vllm-ling's kernel (%s).",
                 selection.reason)
    record_on_config(hf, RESIDUAL_NORM_ATTR, selection)
    return selection


def _install_sum_fold(compilation_config) -> str:
    """Put :class:`~vllm_ling.layers.moe_sum_norm.MoeSumNormPass` in vLLM's post-grad pass slot (it runs before the
    IR lowering, in every compiled piece) unless something else holds the slot; what was done, for the reason."""
    from vllm_ling.layers.moe_sum_norm import MoeSumNormPass

    passes = compilation_config.inductor_compile_config
    held = passes.get(FOLD_PASS_KEY)
    if held is None or isinstance(held, MoeSumNormPass):
        passes[FOLD_PASS_KEY] = held or MoeSumNormPass()
        return FOLDED
    log_once(logger, logging.WARNING, "residual-norm-fold",
             "The MoE's shared + routed sum stays an Inductor kernel before each residual norm: vLLM's %s slot "
             "already holds %s (one pass only); the startup report says so under residual_norm.",
             FOLD_PASS_KEY, type(held).__name__)
    return f"the MoE sum not folded in ({FOLD_PASS_KEY} holds {type(held).__name__})"


def sum_fold_state(compilation_config) -> tuple[bool, str]:
    """Whether this config's compilations were meant to fold the MoE sum into the norms, and if so why they
    cannot (empty: they run the pass the hook installed). Not meant where the model is not compiled by vLLM
    (eager: no pass runs) or no fold was installed (the residual norm opted out, not CUDA, the user's priority)."""
    from vllm.config import CompilationMode

    from vllm_ling.layers.moe_sum_norm import MoeSumNormPass

    held = compilation_config.inductor_compile_config.get(FOLD_PASS_KEY)
    if compilation_config.mode != CompilationMode.VLLM_COMPILE:
        return False, "the model is not compiled by vLLM (no post-grad pass runs)"
    if held is None:
        return False, "no fold installed (the residual norm's decision)"
    if isinstance(held, MoeSumNormPass):
        return True, ""
    return True, f"{FOLD_PASS_KEY} holds {type(held).__name__}"


def _rows_problems(model_config) -> list[str]:
    """Why the kernel cannot normalise the target's residual rows (its hidden size in its activation dtype)."""
    import torch

    from vllm_ling.ops.residual_norm.kernel import shape_problems

    dtype = getattr(model_config, "dtype", torch.bfloat16)
    return shape_problems(int(model_config.hf_config.hidden_size), dtype, dtype)


def recorded_residual_norm(hf_config) -> Selection | None:
    """The decision the config hook recorded (None: the hook did not run for this config)."""
    return recorded_on_config(hf_config, RESIDUAL_NORM_ATTR, Selection, Feature.RESIDUAL_NORM, NormPath)


def priority_in_force() -> list[str]:
    """The providers this process's dispatcher tries for the IR op, in order (what the worker installed)."""
    from vllm import ir

    return list(ir.ops.fused_add_rms_norm.get_priority())
