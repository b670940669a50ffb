"""Startup verification: prove in each worker that every requested optimization is active.

Runs once per worker process, at the target model's first forward (vLLM's profile run),
when vLLM has loaded the target and the NEXTN draft and shared modules between them, and
before the server accepts a request. Each check compares what was requested with the
modules that are really there:

- model classes are vllm-ling's;
- every routed-MoE layer of target and draft serves the MoE selection the quant config recorded on
  it (:func:`vllm_ling.ops.moe.selection.select_moe`: humming on CUDA, the PyTorch reference on CPU,
  vLLM's backend when opted out), read from its method, never derived again here; and the count is
  MoE layers + NEXTN layers;
- every block-FP8 dense linear serves the kernel recorded on it
  (:func:`vllm_ling.ops.dense_fp8.selection.select_dense_fp8`), and the W8A16 kernel agrees with vLLM's;
- the target head runs vllm-ling's FP8 method with a float8_e4m3fn weight of the expected
  byte size and the kernel it recorded (:func:`vllm_ling.ops.lm_head.selection.select_head_kernel`),
  or BF16 when opted out;
- the draft's head(s) and embedding are the target's module objects, and the draft holds no
  storage of that size of its own;
- every MoE router gate is vllm-ling's GateLinear on CUDA, on the router GEMV wherever the kernel
  holds it (:mod:`vllm_ling.runtime.router_gates`; not applicable on CPU);
- every KDA layer of this stage runs one q|k|v|f|g linear filled from the checkpoint, or says why
  not (:mod:`vllm_ling.runtime.kda_in_proj`);
- the speculative config is the one requested;
- vLLM (and on CUDA humming) are the tested versions;
- every kernel that serves a quantized or custom op, found on the loaded layers, matches its
  known answers on small edge-case inputs (:mod:`vllm_ling.runtime.kernel_checks`).

Every rank checks its own modules; the entries are gathered over vLLM's world group (so a
rank on another node is covered too) and the reporting rank writes them under ``ranks``.
The group passes, and an optimization is active, only where it does on every rank. Under
pipeline parallelism a rank checks its stage: the MoE layers of its layer range, and the head
and draft on the last stage only; the report is the last stage's (it holds the head and draft),
written by world rank 0 (the node the API server runs on).

Output: one INFO table, a JSON report (``VLLM_LING_REPORT_PATH``, atomically replaced),
and through it the ``vllm_ling:*`` metrics. Policy ``VLLM_LING_VERIFY``: ``strict`` (the
default) raises :class:`LingVerificationError` so the server refuses to start; ``warn``
logs each failed check at WARNING; ``off`` skips the checks (logged once).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import Any, Callable

import torch

from vllm_ling.log import get_logger, log_once, one_line
from vllm_ling.refusal import Refusal
from vllm_ling.ops.dense_fp8.selection import DenseFp8Kernel
from vllm_ling.ops.moe.selection import MoePath, MoeSelection
from vllm_ling.ops.small_gemv.selection import GemvPath
from vllm_ling.options import LingOptions, MoeDecode, VerifyPolicy, plugin_options, read
from vllm_ling.runtime.report import is_report_source, is_reporting_rank, write_report
from vllm_ling.runtime.spec_policy import VLLM_DSPARK_METHOD, VLLM_MTP_METHOD, Speculation
from vllm_ling.selection import Feature, Selection, recorded
from vllm_ling.versions import (TESTED_HUMMING_VERSION, TESTED_VLLM_VERSION, humming_version,
                                vllm_version)

logger = get_logger("verify")


class LingVerificationError(Refusal, RuntimeError):
    """A requested optimization is not active (policy strict); a refusal (vllm_ling.refusal): the
    message names the fix, so it is the launcher's last line and its traceback stays at DEBUG."""


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    expected: str
    actual: str
    fix: str = ""


@dataclasses.dataclass
class Expectations:
    """The facts the checks take from the options, the platform and the vLLM config. Which backend
    serves each feature is not here: the checks read the selection recorded on each layer."""

    platform: str  # "cpu" | "cuda"
    fp8_head: bool
    spec_method: str | None
    num_speculative_tokens: int
    speculation: Selection | None  # what patch P5 selected and recorded (None: it did not decide)
    kda_merged_proj: bool = False  # each KDA layer's q, k, v, f, g projections are one linear

    @property
    def mtp(self) -> bool:
        """The NEXTN draft is what speculates (another method, e.g. ngram, has no Ling draft)."""
        return self.spec_method == VLLM_MTP_METHOD

    @classmethod
    def from_runtime(cls, vllm_config, options: LingOptions) -> "Expectations":
        from vllm.platforms import current_platform

        platform = "cpu" if current_platform.is_cpu() else "cuda"
        spec = vllm_config.speculative_config
        from vllm_ling.runtime.spec_policy import recorded_speculation

        return cls(platform=platform, fp8_head=options.fp8_head,
                   spec_method=getattr(spec, "method", None),
                   num_speculative_tokens=int(getattr(spec, "num_speculative_tokens", 0) or 0),
                   speculation=recorded_speculation(vllm_config.model_config.hf_config),
                   kda_merged_proj=options.kda_merged_proj)


@dataclasses.dataclass(frozen=True)
class Stage:
    """This process's pipeline stage: rank, size and the target's layer range [start, end)."""

    rank: int
    size: int
    start: int
    end: int

    @property
    def is_last(self) -> bool:
        return self.rank == self.size - 1

    def label(self) -> str:
        return f"pipeline stage {self.rank} of {self.size} (layers {self.start}..{self.end - 1})"


def pipeline_stage(target, num_layers: int) -> Stage:
    """The stage from vLLM's pipeline group and the target's own layer range (the whole model
    when there is no distributed state, e.g. in unit tests)."""
    try:
        from vllm.distributed import get_pp_group

        group = get_pp_group()
        rank, size = group.rank_in_group, group.world_size
    except Exception:  # noqa: BLE001 - no distributed state
        rank, size = 0, 1
    model = getattr(target, "model", None)
    return Stage(rank, size, int(getattr(model, "start_layer", 0)), int(getattr(model, "end_layer", num_layers)))


def _has_head(target) -> bool:
    """False on a pipeline stage without the head (vLLM's PPMissingLayer stands in)."""
    return hasattr(getattr(target, "lm_head", None), "quant_method")


def _routed_expert_layers(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    from vllm.model_executor.layers.fused_moe import RoutedExperts

    return [(n, m) for n, m in model.named_modules() if isinstance(m, RoutedExperts)]


def check_model_classes(target, draft, exp: Expectations, stage: Stage | None = None) -> Check:
    from vllm_ling.models.ling3 import LingForCausalLM
    from vllm_ling.models.ling3_mtp import LingMTPModel

    actual = f"target {type(target).__name__}" + (f", draft {type(draft).__name__}" if draft is not None else "")
    draft_here = exp.mtp and (stage is None or stage.is_last)  # vLLM runs the draft on the last stage
    ok = isinstance(target, LingForCausalLM) and (
        isinstance(draft, LingMTPModel) if draft_here else not isinstance(draft, LingMTPModel))
    expected = "target LingForCausalLM" + (", draft LingMTPModel" if draft_here else
                                           f" (no draft on {stage.label()})" if exp.mtp else "")
    return Check("model_classes", ok, expected, actual,
                 "vllm-ling's plugin did not register its classes: check VLLM_PLUGINS allows vllm_ling")


def _moe_layers(target, draft) -> list[tuple[str, torch.nn.Module]]:
    layers = [("target." + n, m) for n, m in _routed_expert_layers(target)]
    return layers + ([("draft." + n, m) for n, m in _routed_expert_layers(draft)] if draft is not None else [])


def selected_moe(target, draft) -> MoeSelection | None:
    """The MoE selection the quant config recorded (the first layer's; check_moe_layers fails
    where a layer's differs or is missing)."""
    return next((s for _, m in _moe_layers(target, draft) if (s := recorded(m, Feature.MOE)) is not None), None)


def check_moe_layers(target, draft, config, stage: Stage | None = None) -> Check:
    """Every routed-expert layer serves the selection recorded on it (backend and kernel switches,
    read from its method), all layers have the same one, and the count is the stage's MoE layers +
    NEXTN layers."""
    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod, served_selection

    stage = stage or Stage(0, 1, 0, config.num_hidden_layers)
    # vLLM's BailingMoeV3 builds an MoE block for layer_id >= first_k_dense_replace
    moe_layers = sum(1 for i in range(stage.start, stage.end) if i >= config.first_k_dense_replace)
    nextn = config.num_nextn_predict_layers if draft is not None else 0
    layers = _moe_layers(target, draft)
    first = selected_moe(target, draft)
    served: dict[str, int] = {}
    diverging, unselected, other = [], [], []
    for name, layer in layers:
        qm = layer.quant_method
        path, *switches = served_selection(qm)
        label = str(path) if isinstance(qm, LingMxfp4MoEMethod) else f"vllm:{type(qm).__name__}"
        served[label] = served.get(label, 0) + 1
        sel = recorded(layer, Feature.MOE)
        if sel is None:
            unselected.append(name)
        elif (path, *switches) != (sel.choice, sel.w4a8, sel.decode, sel.decode_max_tokens):
            diverging.append(f"{name} (selected {sel.choice}, serves {label})")
        elif sel != first:
            other.append(f"{name} (selected {sel.choice}: {sel.reason})")
    expected_count = moe_layers + nextn
    actual = ", ".join(f"{v} x {k}" for k, v in sorted(served.items())) or "no routed-expert layers"
    for what, names in (("not the recorded selection", diverging), ("no selection recorded", unselected),
                        ("another selection than the first layer's", other)):
        if names:
            actual += f"; {what}: {names[:3]}"
    ok = not (diverging or unselected or other) and len(layers) == expected_count
    where = f" on {stage.label()}" if stage.size > 1 else ""
    choice = first.choice if first is not None else "the ling_fp8 selection"
    return Check("moe_layers", ok,
                 f"{expected_count} x {choice} ({moe_layers} target MoE + {nextn} NEXTN{where}), as selected",
                 actual, f"install humming-kernels {TESTED_HUMMING_VERSION} on an sm_75+ GPU, or opt out with "
                 "VLLM_LING_MOE_BACKEND=vllm; a layer serving other than its selection is a defect: report it")


def moe_decode_summary(target, draft) -> tuple[bool, str]:
    """(every humming MoE layer has its decode kernels, per-status layer counts)."""
    from vllm_ling.layers.moe_method import LingMxfp4MoEMethod

    layers = _routed_expert_layers(target) + (_routed_expert_layers(draft) if draft is not None else [])
    methods = [m.quant_method for _, m in layers if isinstance(m.quant_method, LingMxfp4MoEMethod)]
    counts: dict[str, int] = {}
    for qm in methods:
        status = qm.decode_status or "not built"
        counts[status] = counts.get(status, 0) + 1
    detail = "; ".join(f"{v} x {k}" for k, v in sorted(counts.items())) or "no humming MoE layers"
    return bool(methods) and all(qm.decode_active for qm in methods), detail


DENSE_FP8_MAX_REL_DIFF = 0.1  # vs vLLM's W8A8 kernel: its activation quantization alone is ~2-4% L2


def _block_fp8_linears(target, draft) -> list[tuple[str, torch.nn.Module, Selection | None, DenseFp8Kernel | None]]:
    """(name, layer, recorded selection, what it serves) for every block-FP8 dense linear: the
    linears with a dense FP8 selection recorded, and any with a block-FP8 method without one."""
    from vllm.model_executor.layers.linear import LinearBase

    from vllm_ling.layers.dense_fp8_path import served_dense_fp8_kernel

    found = []
    for prefix, model in (("target.", target), ("draft.", draft)):
        for n, m in (model.named_modules() if model is not None else ()):
            sel = recorded(m, Feature.DENSE_FP8)
            if isinstance(m, LinearBase) and (sel is not None or getattr(
                    getattr(m, "quant_method", None), "weight_block_size", None) is not None):
                found.append((prefix + n, m, sel, served_dense_fp8_kernel(m)))
    return found


def _w8a16_vs_vllm(layer: torch.nn.Module) -> float:
    """Relative L2 difference of the W8A16 kernel to vLLM's (W8A8) kernel on two random rows."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod

    from vllm_ling.layers.dense_fp8_cuda import LingW8A16Fp8LinearMethod

    gen = torch.Generator(device=layer.weight.device).manual_seed(0)
    x = torch.randn((2, layer.input_size_per_partition), device=layer.weight.device, generator=gen,
                    dtype=torch.float32).to(torch.bfloat16)
    with torch.no_grad():
        ours_out = LingW8A16Fp8LinearMethod.apply_w8a16(layer, x).float()
        vllm_out = Fp8LinearMethod.apply(layer.quant_method, layer, x).float()
    return float((ours_out - vllm_out).norm() / vllm_out.norm().clamp_min(1e-30))


def check_dense_fp8(found) -> Check:
    """Every block-FP8 dense linear serves the kernel recorded on it (read from its method and
    loaded state), and a known answer: on the first linear the W8A16 kernel serves, its output for
    two random rows against vLLM's own (W8A8) kernel on the same layer. ``found``:
    :func:`_block_fp8_linears`."""
    selected: dict[str, int] = {}
    diverging, unselected = [], []
    for name, _, sel, served in found:
        if sel is None:
            unselected.append(name)
            continue
        selected[str(sel.choice)] = selected.get(str(sel.choice), 0) + 1
        if served is not sel.choice:
            diverging.append(f"{name} (selected {sel.choice}, serves {served or 'another method'})")
    serving = [(n, m) for n, m, _, served in found if served is DenseFp8Kernel.W8A16]
    actual = f"{len(serving)} of {len(found)} block-FP8 dense linears on the W8A16 kernel"
    if serving:
        actual += f" ({serving[0][1].quant_method.decode_kernel_status})"
    for what, names in (("not the recorded selection", diverging), ("no selection recorded", unselected)):
        if names:
            actual += f"; {what}: {names[:3]}"
    ok = not diverging and not unselected
    expected = (f"each of {len(found)} block-FP8 dense linears on its recorded kernel ("
                + (", ".join(f"{v} x {k}" for k, v in sorted(selected.items())) or "none recorded") + ")")
    fix = ("see the WARNING naming the layers vLLM's processing changed, or set VLLM_LING_DENSE_FP8=vllm; a layer "
           "serving other than its selection is a defect: report it")
    if serving:
        name, layer = serving[0]
        expected += ", the W8A16 kernel agreeing with vLLM's kernel"
        above = layer.quant_method.vllm_kernel_name
        actual += f"; above {layer.ling_w8a16_max_rows} tokens vLLM's {above} (block scales " \
                  f"{getattr(layer, 'ling_block_scales', 'as loaded')})"
        try:
            rel = _w8a16_vs_vllm(layer)
        except Exception as exc:  # the check fails, naming the kernel that raised; the server does not crash
            logger.debug("dense_fp8_layers: known answer on %s raised", name, exc_info=True)
            return Check("dense_fp8_layers", False, expected, actual +
                         f"; known answer on {name} raised {one_line(exc)} (W8A16 kernel vs vLLM's "
                         f"{above})", f"vLLM's {above} cannot run this layer: set VLLM_LING_DENSE_FP8=vllm to "
                         "see whether vLLM's kernel serves it alone, or report the kernel")
        ok = ok and rel < DENSE_FP8_MAX_REL_DIFF
        actual += (f"; known answer on {name}: relative L2 difference to vLLM's kernel {rel:.3g} "
                   f"(limit {DENSE_FP8_MAX_REL_DIFF})")
    return Check("dense_fp8_layers", ok, expected, actual, fix)


SMALL_BF16_MAX_REL_DIFF = 2.0**-7  # vs vLLM's BF16 GEMM: both round once to BF16 from fp32 sums


def _unquantized_linears(model) -> list[tuple[str, torch.nn.Module]]:
    """The linears the checkpoint leaves unquantized: built with the quant config, which gave them
    vLLM's unquantized method (the ones built without one, e.g. the KDA conv weights and the router
    gate, are not the checkpoint's to quantize)."""
    from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod

    return [(n, m) for n, m in model.named_modules()
            if isinstance(m, LinearBase) and getattr(m, "quant_config", None) is not None
            and isinstance(getattr(m, "quant_method", None), UnquantizedLinearMethod)
            and isinstance(getattr(m, "weight", None), torch.Tensor)]


def _small_bf16_layers(target, draft):
    """(every unquantized linear, those on vllm-ling's method, those its small GEMV serves)."""
    from vllm_ling.layers.small_bf16_cuda import LingSmallBf16LinearMethod

    layers = [("target." + n, m) for n, m in _unquantized_linears(target)]
    if draft is not None:
        layers += [("draft." + n, m) for n, m in _unquantized_linears(draft)]
    ours = [(n, m) for n, m in layers if isinstance(m.quant_method, LingSmallBf16LinearMethod)]
    return layers, ours, [(n, m) for n, m in ours if getattr(m, "ling_small_gemv", None) is not None]


def small_bf16_selected(found) -> bool:
    """Some unquantized linear selected vllm-ling's small GEMV (the optimization is requested)."""
    return any((s := recorded(m, Feature.BF16_GEMV)) is not None and s.choice is GemvPath.LING for _, m in found[0])


def check_small_bf16(found) -> Check:
    """Every unquantized linear has the method its recorded selection names (vllm-ling's, where a
    layer the small GEMV cannot hold keeps vLLM's GEMM with one WARNING, counted in ``actual``; or
    vLLM's), and a known answer: on the first served layer, the small GEMV against vLLM's own GEMM on
    the same layer for random rows, one row count per launch shape the kernel picks for that layer
    (CTA width, direct or staged rows). ``found``: :func:`_small_bf16_layers`."""
    from vllm_ling.layers.small_bf16_cuda import LingSmallBf16LinearMethod, served_path

    layers, ours, serving = found
    actual = f"{len(serving)} of {len(layers)} unquantized linears on the small GEMV"
    kept = [f"{n}: {m.ling_small_gemv_reason}" for n, m in ours if getattr(m, "ling_small_gemv", None) is None]
    if kept:
        actual += f"; vLLM's GEMM for {kept[:3]}"
    diverging, unselected = [], []
    for name, m in layers:
        sel = recorded(m, Feature.BF16_GEMV)
        if sel is None:
            unselected.append(name)
        elif served_path(m) is not sel.choice:
            diverging.append(f"{name} (selected {sel.choice}, serves {served_path(m)})")
    for what, names in (("not the recorded selection", diverging), ("no selection recorded", unselected)):
        if names:
            actual += f"; {what}: {names[:3]}"
    fix = ("see the WARNING naming the layers the small GEMV cannot hold, or set VLLM_LING_BF16_GEMV=vllm; a "
           "layer serving other than its selection is a defect: report it")
    if not small_bf16_selected(found):
        return Check("small_bf16_layers", not diverging and not unselected,
                     "vLLM's GEMM on every unquantized linear, as selected (CPU platform or VLLM_LING_BF16_GEMV=vllm)",
                     actual, fix)
    ok = bool(layers) and not diverging and not unselected
    if serving:
        from vllm.model_executor.layers.linear import UnquantizedLinearMethod

        from vllm_ling.ops.small_gemv.kernel import BF16_MAX_ROWS, launch_row_counts

        name, layer = serving[0]
        gen = torch.Generator(device=layer.weight.device).manual_seed(0)
        row_counts = launch_row_counts(layer.weight.shape[0], BF16_MAX_ROWS)
        rel = 0.0
        for rows in row_counts:
            x = torch.randn((rows, layer.weight.shape[1]), device=layer.weight.device, generator=gen)
            x = x.to(torch.bfloat16)
            with torch.no_grad():
                ours_out = LingSmallBf16LinearMethod.apply_small_gemv(layer, x).float()
                vllm_out = UnquantizedLinearMethod.apply(layer.quant_method, layer, x).float()
            rel = max(rel, float((ours_out - vllm_out).norm() / vllm_out.norm().clamp_min(1e-30)))
        ok = ok and rel < SMALL_BF16_MAX_REL_DIFF
        actual += f"; known answer on {name} at {', '.join(map(str, row_counts))} rows: largest relative L2 " \
                  f"difference to vLLM's GEMM {rel:.3g} (limit {SMALL_BF16_MAX_REL_DIFF:.3g})"
    return Check("small_bf16_layers", ok, "every unquantized linear on the method its selection names, the small "
                 "GEMV serving the ones it holds and agreeing with vLLM's GEMM", actual, fix)


def check_head(target, exp: Expectations, stage: Stage | None = None) -> Check:
    from vllm_ling.layers.fp8_lm_head import Fp8LmHeadMethod

    if not _has_head(target):  # vLLM's PPMissingLayer: only the last pipeline stage has the head
        here = f"{type(getattr(target, 'lm_head', None)).__name__} (no head here)"
        if stage is not None and not stage.is_last:
            return Check("lm_head", True, f"no head on {stage.label()}: the last stage holds it", here)
        return Check("lm_head", False, "the head on the last pipeline stage", here,
                     "vLLM built no head where the last stage runs: check --pipeline-parallel-size")
    head = target.lm_head
    qm = head.quant_method
    w = head.weight
    nbytes = w.numel() * w.element_size()
    rows = head.num_embeddings_per_partition if hasattr(head, "num_embeddings_per_partition") else w.shape[0]
    cols = getattr(head, "embedding_dim", None) or w.shape[-1]
    selection = recorded(head, Feature.HEAD_KERNEL)
    if exp.fp8_head:
        # One byte per weight; a GPU kernel's repacked layout may pad a little (BF16 would be 2x). The
        # kernel is the one the head recorded when it selected, read back from its prepared state.
        expected = f"Fp8LmHeadMethod, float8_e4m3fn, {rows * cols} bytes, kernel " + (
            f"{selection.choice} as selected ({selection.reason})" if selection else "as selected")
        ok = (isinstance(qm, Fp8LmHeadMethod) and w.dtype == torch.float8_e4m3fn
              and rows * cols <= nbytes < 1.1 * rows * cols
              and selection is not None and getattr(qm, "kernel", None) is selection.choice)
    else:
        expected = "BF16 head (VLLM_LING_FP8_HEAD=0)"
        ok = not isinstance(qm, Fp8LmHeadMethod) and w.dtype != torch.float8_e4m3fn
    kernel = getattr(qm, "kernel", None)
    actual = f"{type(qm).__name__}, {str(w.dtype).replace('torch.', '')}, {nbytes} bytes" + (
        f", kernel {kernel}" if kernel else "") + ("" if selection is not None or not exp.fp8_head
                                                    else ", no kernel selection recorded")
    return Check("lm_head", ok, expected, actual,
                 "the ling_fp8 quantization was not selected: do not pass --quantization, or set VLLM_LING_FP8_HEAD=0")


def _vocab_rows(module: torch.nn.Module) -> int:
    """Vocabulary rows of a (vocab-parallel) embedding or head on this rank, padding included."""
    rows = getattr(module, "num_embeddings_per_partition", None)
    return int(rows) if rows is not None else int(module.weight.shape[0])


def check_draft_sharing(target, draft, exp: Expectations, stage: Stage | None = None) -> Check:
    if stage is not None and not stage.is_last and draft is None:
        return Check("draft_shares_target_modules", True,
                     f"no draft on {stage.label()}: vLLM runs it on the last stage", "no draft here")
    if exp.spec_method is None:
        return Check("draft_shares_target_modules", True, "no draft (speculation off)", "no draft")
    if not exp.mtp:
        return Check("draft_shares_target_modules", True,
                     f"no NEXTN draft (--speculative-config method {exp.spec_method}: MTP not requested)",
                     "no NEXTN draft" if draft is None else f"draft {type(draft).__name__}")
    if draft is None:
        return Check("draft_shares_target_modules", False, "draft loaded", "no NEXTN draft in this process",
                     "the speculative config names no Ling MTP draft")
    heads = draft.heads()
    same_head = all(h is target.lm_head for h in heads)
    target_embed = target.model.word_embeddings
    # vLLM shares the embedding with the draft only without pipeline parallelism: on a later
    # stage the target has none (PPMissingLayer) and the draft keeps its own, as vLLM intends
    embed_here = hasattr(target_embed, "weight")
    same_embed = draft.model.embed_tokens is target_embed if embed_here else True
    own = draft.own_storage_bytes(target)
    head_bytes = target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    # A duplicate head or embedding is a [vocab rows, ...] tensor the target does not own. The rows
    # are the modules' logical vocabulary: a GPU head kernel's repacked weight has other dimensions
    # (humming's FP8 head is [hidden / 16, ...]: on the tiny model 16 rows, as many as its experts).
    vocab_rows = {_vocab_rows(target.lm_head)} | ({_vocab_rows(target_embed)} if embed_here else set())
    target_ptrs = {q.data_ptr() for q in target.parameters()}
    draft_embed = getattr(draft.model.embed_tokens, "weight", None)
    big_own = [n for n, p in draft.named_parameters()
               if p.dim() == 2 and p.shape[0] in vocab_rows and p.data_ptr() not in target_ptrs
               and (embed_here or p is not draft_embed)]
    ok = same_head and same_embed and not big_own
    if big_own:
        actual_extra = f"; duplicate vocabulary-sized tensors in the draft: {big_own[:3]}"
    else:
        actual_extra = ""
    path = draft.ling_sharing_path or "vLLM proposer module sharing"
    embed_text = (f"embedding {'is' if same_embed else 'is NOT'} the target's" if embed_here else
                  "embedding is the draft's own (the target's is on the first pipeline stage)")
    actual = (f"{len(heads)} head ref(s) {'are' if same_head else 'are NOT all'} the target's module; "
              f"{embed_text}; draft-only storage {own} bytes (head {head_bytes} bytes); path: {path}{actual_extra}")
    return Check("draft_shares_target_modules", ok,
                 "draft head(s) and embedding are the target's objects; no duplicate storage", actual,
                 "the draft must share the target's whole head module (weights, scales, method); "
                 "do not share only the weight tensor")


def check_speculative(exp: Expectations, options: LingOptions) -> Check:
    """The speculative config in force is the one patch P5 selected and recorded
    (:func:`vllm_ling.runtime.spec_policy.select_speculation`)."""
    sel = exp.speculation
    choice = sel.choice if sel is not None else None
    if choice is Speculation.DEFAULT_MTP:
        expected = f"{VLLM_MTP_METHOD}, {options.num_spec_tokens} tokens (vllm-ling default)"
        ok = exp.mtp and exp.num_speculative_tokens == options.num_spec_tokens
    elif choice is Speculation.DEFAULT_DSPARK:
        expected = f"{VLLM_DSPARK_METHOD}, drafter {options.dspark_model} (vllm-ling default)"
        ok = exp.spec_method == VLLM_DSPARK_METHOD
    elif choice in (Speculation.OFF, Speculation.OFF_NO_NEXTN, Speculation.OFF_PIPELINE):
        expected, ok = f"off ({sel.reason})", exp.spec_method is None
    elif choice is Speculation.USER:
        expected, ok = "as configured by the user", exp.spec_method is not None
    elif options.mtp and exp.spec_method is None:  # nothing recorded: P5 did not run for this target
        expected, ok = f"{VLLM_MTP_METHOD} (VLLM_LING_MTP=1; no speculative selection recorded)", False
    else:
        expected = "as configured by the user" if exp.spec_method else "off (VLLM_LING_MTP=0)"
        ok = True
    actual = f"{exp.spec_method}, {exp.num_speculative_tokens} tokens" if exp.spec_method else "off"
    return Check("speculative_config", ok, expected, actual,
                 "pass --speculative-config '{\"method\": \"mtp\", \"num_speculative_tokens\": 3}'")


def check_versions(exp: Expectations) -> Check:
    v, h = vllm_version(), humming_version()
    ok = (v or "").split("+")[0] == TESTED_VLLM_VERSION and (exp.platform == "cpu" or h == TESTED_HUMMING_VERSION)
    return Check("versions", ok, f"vllm {TESTED_VLLM_VERSION}, humming {TESTED_HUMMING_VERSION}"
                 + (" (unused on CPU)" if exp.platform == "cpu" else ""),
                 f"vllm {v}, humming {h}", f"pip install vllm-ling[{'cpu' if exp.platform == 'cpu' else 'gpu'}]")


def _gpu_arch() -> str | None:
    if torch.cuda.is_available():
        major, minor = torch.cuda.get_device_capability()
        return f"sm_{major}{minor}"
    return None


def guarded(name: str, run: Callable[[], Check]) -> Check:
    """``run()``; an exception inside a check is that check's failure (traceback at DEBUG), so a
    strict start ends with one refusal line naming it, never a crash of the engine."""
    try:
        return run()
    except Exception as exc:
        logger.debug("verification check %s raised", name, exc_info=True)
        return Check(name, False, "the check completes", f"the check raised {one_line(exc)}",
                     "a defect in the check or in what it inspects: run with VLLM_LING_VERIFY=warn to serve "
                     "anyway, and report the message")


def build_report(target, draft, vllm_config, options: LingOptions,
                 exp: Expectations | None = None) -> dict[str, Any]:
    from vllm_ling.runtime import dspark_checks, kda_in_proj, kernel_checks, router_gates

    exp = exp or Expectations.from_runtime(vllm_config, options)
    config = vllm_config.model_config.hf_config
    known = kernel_checks.report_section(target, draft)
    stage = pipeline_stage(target, config.num_hidden_layers)
    gates = router_gates.gate_census(target, draft)
    bf16_linears = _small_bf16_layers(target, draft)
    dense_linears = _block_fp8_linears(target, draft)
    dense_requested = any(sel is not None and sel.choice is DenseFp8Kernel.W8A16 for _, _, sel, _ in dense_linears)
    kda_state = kda_in_proj.kda_in_proj_state(target)
    checks = [guarded("model_classes", lambda: check_model_classes(target, draft, exp, stage)),
              guarded("moe_layers", lambda: check_moe_layers(target, draft, config, stage)),
              guarded("lm_head", lambda: check_head(target, exp, stage)),
              guarded("draft_shares_target_modules", lambda: check_draft_sharing(target, draft, exp, stage)),
              guarded("dense_fp8_layers", lambda: check_dense_fp8(dense_linears)),
              guarded("small_bf16_layers", lambda: check_small_bf16(bf16_linears)),
              guarded(kda_in_proj.CHECK_NAME, lambda: Check(kda_in_proj.CHECK_NAME, *kda_in_proj.check_kda_in_proj(
                  kda_state, exp.kda_merged_proj, config, stage.start, stage.end))),
              guarded(router_gates.CHECK_NAME, lambda: Check(
                  router_gates.CHECK_NAME, *router_gates.check_router_gates(gates, exp.platform))),
              guarded("speculative_config", lambda: check_speculative(exp, options)),
              guarded("versions", lambda: check_versions(exp)),
              Check(kernel_checks.CHECK_NAME, known["passed"], kernel_checks.EXPECTED, known["summary"],
                    kernel_checks.FIX)]
    dspark = exp.spec_method == VLLM_DSPARK_METHOD
    dspark_rows = dspark_checks.readings(target, draft, vllm_config) if dspark and stage.is_last else []
    checks += [Check(**dataclasses.asdict(r)) for r in dspark_rows]
    by_name = {c.name: c for c in checks}
    moe = selected_moe(target, draft)
    moe_path = moe.choice if moe is not None else MoePath.VLLM  # nothing of ours selected: vLLM's
    moe_active = moe_path is not MoePath.VLLM and by_name["moe_layers"].passed
    head_active = exp.fp8_head and by_name["lm_head"].passed
    mtp_active = exp.mtp and by_name["draft_shares_target_modules"].passed
    decode_requested = moe_path is MoePath.HUMMING and moe.decode is not MoeDecode.OFF
    decode_active, decode_detail = moe_decode_summary(target, draft)
    return {
        "passed": all(c.passed for c in checks),
        "policy": options.verify,
        "platform": exp.platform,
        "gpu_arch": _gpu_arch(),
        "versions": {"vllm": vllm_version() or "unknown", "humming": humming_version()},
        "optimizations": {
            # Humming is requested only where it can exist (CUDA) and the user did not opt out.
            "moe_humming": {"requested": moe_path is MoePath.HUMMING,
                            "active": moe_active and moe_path is MoePath.HUMMING,
                            "detail": by_name["moe_layers"].actual if moe_path is not MoePath.VLLM
                            else f"{moe.reason if moe else 'not selected by ling_fp8'}: vLLM chooses"},
            # Sub-path of moe_humming: fused kernels for batches <= VLLM_LING_MOE_DECODE_MAX_TOKENS.
            "moe_decode_kernels": {"requested": decode_requested, "active": decode_requested and decode_active,
                                   "detail": decode_detail if moe_path is MoePath.HUMMING
                                   else "needs the humming MoE backend on CUDA"},
            "fp8_head": {"requested": options.fp8_head, "active": head_active,
                         "detail": by_name["lm_head"].actual},
            "dense_fp8_decode": {"requested": dense_requested,
                                 "active": dense_requested and by_name["dense_fp8_layers"].passed,
                                 "detail": by_name["dense_fp8_layers"].actual},
            "small_bf16_decode": {"requested": small_bf16_selected(bf16_linears),
                                  "active": small_bf16_selected(bf16_linears) and by_name["small_bf16_layers"].passed
                                  and bool(bf16_linears[2]),
                                  "detail": by_name["small_bf16_layers"].actual},
            "router_gemv": router_gates.optimization_entry(gates, by_name[router_gates.CHECK_NAME].passed,
                                                           exp.platform, known),
            "kda_merged_in_proj": kda_in_proj.optimization_entry(
                kda_state, by_name[kda_in_proj.CHECK_NAME].passed, exp.kda_merged_proj,
                by_name[kda_in_proj.CHECK_NAME].actual),
            "mtp": {"requested": exp.mtp, "active": mtp_active, "detail": _mtp_detail(exp, by_name)},
            "dspark": dspark_checks.optimization_entry(dspark, dspark_rows),
        },
        "moe_backend": moe_path,
        "head_dtype": (str(target.lm_head.weight.dtype).replace("torch.", "") if _has_head(target)
                       else f"none ({stage.label()})"),
        "spec_method": exp.spec_method,
        "num_speculative_tokens": exp.num_speculative_tokens,
        "checks": [dataclasses.asdict(c) for c in checks],
        "smoke": {"accept_length": None, "threshold": 0.0, "passed": None},
        "kernel_checks": known,
        "notes": _serving_notes(vllm_config, known),
        "memory": {"weights_bytes": weights_bytes(target, draft)},
    }


def _mtp_detail(exp: Expectations, by_name: dict[str, Check]) -> str:
    off_by_design = {Speculation.OFF_NO_NEXTN: "the checkpoint has no NEXTN layers (num_nextn_predict_layers=0)",
                     Speculation.OFF_PIPELINE: "pipeline parallelism (vLLM 0.32 runs no draft model there)"}
    if exp.speculation is not None and exp.speculation.choice in off_by_design and exp.spec_method is None:
        return "not requested: " + off_by_design[exp.speculation.choice]
    if exp.spec_method is not None and not exp.mtp:
        return f"not requested: --speculative-config method {exp.spec_method}"
    return by_name["draft_shares_target_modules"].actual


def weights_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes of the parameters and buffers of the given modules in this worker, each storage
    once (the draft shares the target's head and embedding)."""
    from vllm_ling.runtime.startup_facts import distinct_storage_bytes

    return distinct_storage_bytes(t for m in modules if m is not None for t in [*m.parameters(), *m.buffers()])


def _serving_notes(vllm_config, known: dict[str, Any]) -> list[str]:
    """What computes, as read from the loaded layers' methods and kernels (not the platform)."""
    served = [f"{r['name']}: {r['kernel']}" for r in known["results"]]
    dense = known["dense_fp8"]
    if dense["kernels"]:
        served.append("dense block-FP8 linears: " + ", ".join(
            f"{n} x {k}" for k, n in sorted(dense["kernels"].items())))
    notes = ["serving kernels: " + "; ".join(served)] if served else []
    if dense["path_choice"]:
        notes.append("dense block-FP8 path: " + dense["path_choice"]["reason"])
    if not vllm_config.cache_config.enable_prefix_caching:
        notes.append("prefix caching is off")
    return notes


def format_table(report: dict[str, Any]) -> str:
    rows = [("check", "ok", "expected", "actual")]
    rows += [(c["name"], "yes" if c["passed"] else "NO", c["expected"], c["actual"]) for c in report["checks"]]
    widths = [min(max(len(r[i]) for r in rows), 60) for i in range(3)]
    lines = [f"vllm-ling startup verification ({report['platform']}, policy {report['policy']}"
             f"{', runner ' + report['model_runner'] if report.get('model_runner') else ''}): "
             f"{'PASSED' if report['passed'] else 'FAILED'}"]
    for r in rows:
        lines.append("  " + "  ".join(r[i][:60].ljust(widths[i]) for i in range(3)) + "  " + r[3])
    if report.get("kernel_checks"):
        from vllm_ling.runtime.kernel_checks import table_lines

        lines += ["  " + line for line in table_lines(report["kernel_checks"])]
    for note in report.get("notes", []):
        lines.append("  note: " + note)
    return "\n".join(lines)


def apply_negative_control(target, draft) -> None:
    """VLLM_LING_NEGATIVE_CONTROL=weight_only_head: rebuild the upstream trap on purpose."""
    mode = read("VLLM_LING_NEGATIVE_CONTROL") or ""
    if not mode:
        return
    if mode != "weight_only_head":
        raise ValueError(f"VLLM_LING_NEGATIVE_CONTROL={mode!r}: the only control is 'weight_only_head'")
    if draft is None:
        return
    from vllm_ling.models.ling3_mtp import build_weight_only_trap

    trap = build_weight_only_trap(target.lm_head)
    for layer in draft.model.layers.values():
        layer.shared_head.head = trap
    draft.lm_head = trap
    draft.ling_sharing_path = "NEGATIVE CONTROL: weight tensor only (the trap)"
    log_once(logger, logging.WARNING, "negative-control",
             "NEGATIVE CONTROL active: the NEXTN draft uses the target's FP8 head weight without its "
             "scales or method (the silent-degradation trap, on purpose)")


def enforce_policy(report: dict[str, Any], policy: str) -> None:
    """strict: raise naming every failed check and its fix; warn: one WARNING per check."""
    if report["passed"] or policy == VerifyPolicy.OFF:
        return
    failed = [c for c in report["checks"] if not c["passed"]]
    if policy == VerifyPolicy.STRICT:
        message = "; ".join(f"{c['name']}: expected {c['expected']}, got {c['actual']}. Fix: {c['fix']}"
                            for c in failed)
        raise LingVerificationError(
            f"vllm-ling refuses to serve: startup verification failed ({message}). "
            "Set VLLM_LING_VERIFY=warn to serve anyway.")
    for c in failed:
        logger.warning("verification check %s FAILED: expected %s, got %s. Fix: %s",
                       c["name"], c["expected"], c["actual"], c["fix"])


def _node_address() -> str:
    """This rank's node as Ray names it (a Ray worker), else vLLM's host address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    from vllm.utils.network_utils import get_ip

    return get_ip()


def rank_entry(report: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of the report: where it runs, what it read, what it found."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_world_group

        rank, tp_rank, pp_rank = (get_world_group().rank_in_group, get_tensor_model_parallel_rank(),
                                  get_pp_group().rank_in_group)
    except Exception:  # no distributed state (unit tests build models directly)
        rank = tp_rank = pp_rank = 0
    return {"rank": rank, "tp_rank": tp_rank, "pp_rank": pp_rank, "node_ip": _node_address(),
            "pid": os.getpid(), "passed": report["passed"], "head_dtype": report["head_dtype"],
            "optimizations": {n: {"requested": e["requested"], "active": e["active"]}
                              for n, e in report["optimizations"].items()},
            "checks": report["checks"],
            # the switches as this process saw them (propagation: vllm_ling/runtime/ray_env.py)
            "options": {o.name: os.environ.get(o.name, "") for o in plugin_options()}}


def gather_ranks(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's entry, on every rank, ordered by rank (a collective: all ranks call it)."""
    try:
        from vllm.distributed import get_world_group

        group = get_world_group()
    except Exception:
        return [entry]
    if group.world_size == 1:
        return [entry]
    entries: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(entries, entry, group=group.cpu_group)
    return sorted(entries, key=lambda e: e["rank"])


def check_ranks_agree(ranks: list[dict[str, Any]]) -> Check:
    """Every rank read the same vllm-ling settings (each rank checks against its own, so a rank
    with a stale node-local value would otherwise pass its checks while serving differently)."""
    names = sorted({n for r in ranks for n in r["options"]})
    differ = [f"{n}: " + ", ".join(f"rank {r['rank']} ({r['node_ip']}) {r['options'].get(n, '')!r}"
                                  for r in ranks)
              for n in names if len({r["options"].get(n, "") for r in ranks}) > 1]
    return Check("ranks_agree", not differ, "the same vllm-ling settings on every rank",
                 "; ".join(differ) or f"{len(ranks)} rank(s), same settings",
                 "set VLLM_LING_* on the launching process only (vllm-ling serve passes them to "
                 "every Ray worker) and remove stale ones from the other nodes' environment")


def merge_ranks(report: dict[str, Any], ranks: list[dict[str, Any]]) -> Check:
    """The group's verdict in ``report``: passed and active only where true on every rank, and
    the ranks' settings agree. Returns the agreement check."""
    agree = check_ranks_agree(ranks)
    report["ranks"] = ranks
    report["checks"] = report["checks"] + [dataclasses.asdict(agree)]
    report["passed"] = all(r["passed"] for r in ranks) and agree.passed
    for name, entry in report["optimizations"].items():
        off = [r for r in ranks if not r["optimizations"].get(name, {}).get("active", False)]
        if entry["active"] and off:
            entry["active"] = False
            entry["detail"] += "; inactive on rank(s) " + ", ".join(
                f"{r['rank']} ({r['node_ip']})" for r in off)
    return agree


def format_ranks(ranks: list[dict[str, Any]]) -> str:
    lines = []
    for r in ranks:
        failed = [c["name"] for c in r["checks"] if not c["passed"]]
        lines.append(f"  rank {r['rank']} (tp {r['tp_rank']}, pp {r['pp_rank']}) on {r['node_ip']} "
                     f"pid {r['pid']}: {'PASSED' if r['passed'] else 'FAILED ' + ', '.join(failed)}; "
                     f"head {r['head_dtype']}")
    return "\n".join(lines)


_done = False


def verify_once(target, vllm_config, runner: str | None = None) -> dict[str, Any] | None:
    """Run the verification the first time it is called in this process."""
    global _done
    if _done:
        return None
    _done = True
    from vllm_ling.models import loaded

    options = LingOptions.from_env()
    draft = loaded.get("draft") if vllm_config.speculative_config is not None else None
    apply_negative_control(target, draft)
    if options.verify is VerifyPolicy.OFF:
        log_once(logger, logging.WARNING, "verify-off",
                 "Startup verification is OFF (VLLM_LING_VERIFY=off): optimizations are not checked.")
        return None
    own = build_report(target, draft, vllm_config, options)
    own["model_runner"] = runner or "first forward (no runner hook)"
    entry = rank_entry(own)
    if is_report_source():  # the last stage's report travels to the writer (world rank 0)
        entry["report"] = own
    ranks = gather_ranks(entry)
    sources = [r.pop("report") for r in ranks if "report" in r]
    source = sources[0] if sources else own
    report = dict(source, optimizations={n: dict(e) for n, e in source["optimizations"].items()})
    agree = merge_ranks(report, ranks)
    if is_reporting_rank():
        logger.info("%s\n%s", format_table(report), format_ranks(report["ranks"]))
        if options.report_path:
            write_report(report, options.report_path)
    # each rank refuses for its own failed checks and for settings that differ between ranks
    enforce_policy(dict(own, checks=own["checks"] + [dataclasses.asdict(agree)],
                        passed=own["passed"] and agree.passed), options.verify)
    return report
