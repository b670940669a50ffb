"""FlashAttention's split-KV bound for decode steps in full CUDA graphs, raised for small batches.

Why: under full CUDA graphs vLLM caps FlashAttention's decode splits at
``attention_config.flash_attn_max_num_splits_for_cuda_graph`` (32), so the out-of-graph buffers
it sizes for capture stay small. At batch 1 an MLA decode is one tile of query rows (Ling's 32
heads packed over the one latent KV head), so the kernel runs ``splits`` CTAs: 32 of an H100's
132 SMs read the latent cache, 39 us per layer at 32K context where the bytes take 12
(``benchmarks/results/serve_h200_runs/lease-2026-12-07g``). Eager steps are not capped:
FlashAttention 3 picks up to 128 splits itself. The bound matters only where few query tiles
meet a long context, which is batch 1 and the speculative verify window.

What it costs: each split keeps an fp32 partial output and log-sum-exp per head and decode token,
so the bound is raised only as far as that fits :data:`ACCUM_BUDGET_BYTES` for the largest decode
batch (``--max-num-seqs`` x the decode query length); a large-batch server keeps vLLM's bound (a
fallback: one WARNING, and the report's entry requested but inactive).

The config hook (P4) decides before the engine starts, writes the bound into vLLM's
``attention_config`` (the metadata builders read it when they are built), and records the
decision on the target's hf_config, which reaches every worker. The startup verification checks
the bound in force in each worker against the record
(:mod:`vllm_ling.runtime.verification.decode_splits`); after warm-up each worker reads the
bound its attention metadata builders hold (:func:`builder_bounds`).
"""

from __future__ import annotations

import dataclasses
import logging

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import Choice, LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Selection, record_on_config, recorded_on_config

logger = get_logger("config")

DECODE_SPLITS_ATTR = "vllm_ling_decode_splits"
VLLM_BOUND_FIELD = "flash_attn_max_num_splits_for_cuda_graph"
# Split buffers (fp32 partial outputs + LSE) of the largest decode batch at most this large.
ACCUM_BUDGET_BYTES = 256 << 20
ACCUM_BYTES = 4  # fp32


class DecodeSplits(Choice):
    RAISED = "raised"        # the bound raised above vLLM's
    KEPT = "kept"            # VLLM_LING_DECODE_SPLITS not above vLLM's bound: vLLM's
    BUDGET = "budget"        # a fallback: more splits' buffers exceed the budget at this decode batch (vLLM's bound)
    OPTED_OUT = "vllm"       # VLLM_LING_DECODE_SPLITS=0: vLLM's bound
    USER = "user"            # the user's --attention-config bound
    NO_FULL_GRAPHS = "none"  # no full CUDA graphs (--enforce-eager, or the user's cudagraph mode): no bound applies
    NOT_CUDA = "not_cuda"    # no FlashAttention on this platform


SERVING = frozenset((DecodeSplits.RAISED,))
FALLBACK = frozenset((DecodeSplits.BUDGET,))  # asked for (the default) and not served


@dataclasses.dataclass(frozen=True)
class DecodeSplitsSelection(Selection):
    """``bound``: the value of vLLM's ``flash_attn_max_num_splits_for_cuda_graph`` once this decision
    is applied."""

    bound: int = 0

    def served_as(self) -> tuple:
        return (self.choice, self.bound)


def vllm_default_bound() -> int:
    """vLLM's own bound (its AttentionConfig field's default)."""
    from vllm.config.attention import AttentionConfig

    return AttentionConfig.__dataclass_fields__[VLLM_BOUND_FIELD].default


def split_bytes(heads: int, decode_tokens: int, value_dim: int) -> int:
    """One split's buffers: an fp32 partial output and LSE per head and decode token."""
    return heads * decode_tokens * (value_dim + 1) * ACCUM_BYTES


def bound_within_budget(wanted: int, floor: int, per_split: int, budget: int = ACCUM_BUDGET_BYTES) -> int:
    """``wanted`` halved until its buffers fit ``budget``, never below ``floor`` (vLLM's bound)."""
    bound = wanted
    while bound > floor and bound * per_split > budget:
        bound //= 2
    return max(bound, floor)


def full_graphs_possible(vllm_config) -> bool:
    """False where decode cannot run in full CUDA graphs whatever vLLM resolves later: eager mode, or a
    cudagraph mode the user gave without full graphs (vLLM resolves its default after the config hook)."""
    if getattr(vllm_config.model_config, "enforce_eager", False):
        return False
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    return mode is None or mode.has_full_cudagraphs()


def decide_decode_splits(vllm_config, options: LingOptions | None = None,
                         on_cuda: bool | None = None) -> DecodeSplitsSelection:
    """Decide, apply to ``vllm_config.attention_config`` and record on the target's hf_config."""
    options = options or LingOptions.current()
    if on_cuda is None:
        from vllm.platforms import current_platform

        on_cuda = current_platform.is_cuda()
    attention = vllm_config.attention_config
    default, current = vllm_default_bound(), getattr(attention, VLLM_BOUND_FIELD)
    hf = vllm_config.model_config.hf_config
    earlier = recorded_decode_splits(hf)
    if earlier is not None and earlier.bound == current:  # a second build of the same config: its decision stands
        return earlier
    def decided(choice: DecodeSplits, reason: str, bound: int = current) -> DecodeSplitsSelection:
        return DecodeSplitsSelection(Feature.DECODE_SPLITS, choice, reason, bound=bound)

    if not on_cuda:
        selection = decided(DecodeSplits.NOT_CUDA, "no FlashAttention decode on this platform")
    elif not full_graphs_possible(vllm_config):
        selection = decided(DecodeSplits.NO_FULL_GRAPHS, "no full CUDA graphs: FlashAttention picks its own splits")
    elif current != default:
        selection = decided(DecodeSplits.USER, f"--attention-config {VLLM_BOUND_FIELD}={current}")
    elif options.decode_splits == 0:
        selection = decided(DecodeSplits.OPTED_OUT, f"opted out ({opt_out_setting('VLLM_LING_DECODE_SPLITS')})")
        log_once(logger, logging.WARNING, "decode-splits-off",
                 "FlashAttention's decode splits stay at vLLM's %d in CUDA graphs (%s): a batch-1 decode at "
                 "long context reads the MLA cache with that many CTAs.", current, selection.reason)
    elif options.decode_splits <= current:
        selection = decided(DecodeSplits.KEPT,
                            f"vLLM's {current}: VLLM_LING_DECODE_SPLITS={options.decode_splits} is not above it (a lower "
                            f"bound is `--attention-config '{{\"{VLLM_BOUND_FIELD}\": N}}'`)")
    else:
        heads = hf.num_attention_heads // max(1, vllm_config.parallel_config.tensor_parallel_size)
        spec = vllm_config.speculative_config
        tokens = vllm_config.scheduler_config.max_num_seqs * (1 + (getattr(spec, "num_speculative_tokens", 0) or 0))
        per_split = split_bytes(heads, tokens, hf.kv_lora_rank)
        bound = bound_within_budget(options.decode_splits, current, per_split)
        if bound > current:
            setattr(attention, VLLM_BOUND_FIELD, bound)
            selection = decided(DecodeSplits.RAISED,
                                f"above vLLM's {current}: the split buffers take {bound * per_split / 2**20:.0f} MiB "
                                f"at {tokens} decode tokens", bound)
            log_once(logger, logging.INFO, "decode-splits",
                     "FlashAttention decode steps in CUDA graphs may split the KV cache %d ways (%s).",
                     bound, selection.reason)
        else:
            selection = decided(DecodeSplits.BUDGET, f"vLLM's {current}: more splits' buffers exceed "
                                f"{ACCUM_BUDGET_BYTES >> 20} MiB at {tokens} decode tokens (--max-num-seqs)")
            log_once(logger, logging.WARNING, "decode-splits-budget",
                     "FlashAttention's decode splits stay at vLLM's %d in CUDA graphs (%s): a batch-1 decode at long "
                     "context reads the MLA cache with that many CTAs. A smaller --max-num-seqs raises them, or give "
                     "--attention-config '{\"%s\": N}' yourself.", current, selection.reason, VLLM_BOUND_FIELD)
    record_decode_splits(hf, selection)
    return selection


def record_decode_splits(hf_config, selection: DecodeSplitsSelection) -> None:
    record_on_config(hf_config, DECODE_SPLITS_ATTR, selection)


def recorded_decode_splits(hf_config) -> DecodeSplitsSelection | None:
    """The decision the config hook recorded (None: the hook did not run for this config)."""
    return recorded_on_config(hf_config, DECODE_SPLITS_ATTR, DecodeSplitsSelection, Feature.DECODE_SPLITS, DecodeSplits)


def bound_in_force(vllm_config) -> int:
    """The bound this process's FlashAttention metadata builders are built with."""
    return int(getattr(vllm_config.attention_config, VLLM_BOUND_FIELD))


def builder_bounds(model_runner) -> dict[str, list[int]]:
    """``{builder class: its builders' distinct max_num_splits}`` over the attention metadata builders a
    model runner (and its drafter) built that cap FlashAttention's splits; 0 means uncapped (no full CUDA
    graphs)."""
    groups = list(getattr(model_runner, "attn_groups", None) or [])
    for holder in (getattr(model_runner, "speculator", None), getattr(model_runner, "drafter", None)):
        groups += list(getattr(holder, "attn_groups", None) or [])
    bounds: dict[str, set[int]] = {}
    for group in (g for kind in groups for g in (kind if isinstance(kind, (list, tuple)) else [kind])):
        for builder in getattr(group, "metadata_builders", None) or ():
            if isinstance(getattr(builder, "max_num_splits", None), int):
                bounds.setdefault(type(builder).__name__, set()).add(builder.max_num_splits)
    return {name: sorted(values) for name, values in bounds.items()}
