"""The drafter feature's :class:`~vllm_ling.selection.Reader`: what a loaded DSpark drafter serves,
read from the drafter, the target it drafts for and the config vLLM built both with, in the words
of :mod:`vllm_ling.models.dspark_selection` (so the verification compares it with the record):

- the draft tokens per block vLLM's D-Spark runtime drafts (its speculative config);
- the target layers whose input the target captures for it (``aux_hidden_state_layers``, set by
  vLLM's runner from the drafter's ``target_layer_ids``);
- the model runner (vLLM 0.32 runs D-Spark only in Model Runner V2);
- the verify window every KDA layer's state can roll back (its speculative state slots and conv
  columns, from the layer's own KV-cache spec);
- the draft attention layers' KV pages against the hybrid target's page (vllm-ling sizes them:
  :mod:`vllm_ling.models.dspark_blocks`);
- the Markov projection's method (vLLM's Markov gather reads its weight directly: BF16 only).

Whether the drafter's head and embedding are the target's modules is the draft-sharing family's
row (:mod:`vllm_ling.runtime.verification.draft_sharing`, as for the NEXTN draft); the ``dspark``
optimization needs it (``needs_rows``). vLLM's own ``Qwen3DSparkForCausalLM`` (the upstream routing
of a Ling drafter) records nothing and is named.
"""

from __future__ import annotations

from vllm_ling.models.dspark_selection import (MARKOV_BF16, PAGES_FIT, RUNNER_V1, RUNNER_V2, kda_switch,
                                               layers_switch, tokens_switch)
from vllm_ling.options import Drafter
from vllm_ling.selection import DRAFT_SHARING_ROW, Feature, Reader, Served


def _is_dspark_drafter(module) -> bool:
    from vllm.model_executor.models.qwen3_dspark import Qwen3DSparkForCausalLM

    return isinstance(module, Qwen3DSparkForCausalLM)


def kda_verify_window(target, vllm_config) -> int | None:
    """The longest verify window every KDA layer can roll back: one recurrent state per draft slot
    (``num_speculative_blocks``) plus the current one, and conv columns for as many tokens past
    the kernel's own ``W - 1`` (None: no KDA layer)."""
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    windows = []
    for layer in (m for m in target.modules() if isinstance(m, MambaBase)):
        spec = layer.get_kv_cache_spec(vllm_config)
        columns = min(spec.shapes[0])  # the conv state is (channels, columns) or transposed; columns are few
        windows.append(min(spec.num_speculative_blocks, columns - (layer.conv_size - 1)) + 1)
    return min(windows) if windows else None


def draft_pages(draft, vllm_config) -> str:
    """:data:`PAGES_FIT` where every draft attention layer reports the block vllm-ling sized and its
    page fits the page the hybrid target's layers share; else what does not."""
    from vllm_ling.models.dspark_blocks import BLOCK_ATTR, unified_page_bytes
    from vllm_ling.models.ling3 import LingForCausalLM

    page = unified_page_bytes(vllm_config, LingForCausalLM)
    wrong = []
    for i, layer in enumerate(draft.model.layers):
        attn = layer.self_attn.attn
        spec = attn.get_kv_cache_spec(vllm_config)
        sized = getattr(attn, BLOCK_ATTR, None)
        if page is not None and (spec.block_size != sized or spec.page_size_bytes > page):
            wrong.append(f"layer {i}: block {spec.block_size} (sized {sized}), page {spec.page_size_bytes} B")
    if not draft.model.layers:
        return "no draft attention layer"
    return PAGES_FIT if not wrong else f"draft KV pages over the {page} B hybrid page: {wrong[:2]}"


def served(draft) -> Served:
    from vllm_ling.models.ling3_dspark import LingDSparkForCausalLM

    if not isinstance(draft, LingDSparkForCausalLM):
        return Served.of(None, label=f"vLLM's {type(draft).__name__}, not vllm-ling's LingDSparkModel")
    config, target = draft.ling_vllm_config, draft.ling_target()
    if target is None:
        return Served.of(None, label="a drafter whose target is gone")
    markov = type(draft.model.markov_head.markov_w2.quant_method).__name__
    switches = (tokens_switch(int(config.speculative_config.num_speculative_tokens)),
                layers_switch(tuple(getattr(target.model, "aux_hidden_state_layers", ()))),
                RUNNER_V2 if config.use_v2_model_runner else RUNNER_V1,
                kda_switch(kda_verify_window(target, config)), draft_pages(draft, config),
                MARKOV_BF16 if markov == "UnquantizedEmbeddingMethod" else f"Markov projection {markov}")
    return Served.of(Drafter.DSPARK, *switches, label=f"dspark ({', '.join(switches)})")


READER = Reader(
    Feature.DRAFTER, "dspark_drafter", "DSpark drafters", _is_dspark_drafter, served,
    "serve the drafter as vllm-ling's LingDSparkModel (VLLM_LING_DSPARK_MODEL or --dspark-model) on vLLM's Model "
    "Runner V2 with at most its block_size draft tokens; a drafter serving other than it recorded is a defect: "
    "report it",
    optimization="dspark", optimizing=frozenset({Drafter.DSPARK}), needs_rows=(DRAFT_SHARING_ROW,))
