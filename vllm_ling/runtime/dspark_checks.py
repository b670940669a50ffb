"""What the DSpark drafter serves, read from the loaded models and vLLM's config.

Small self-contained readers for the startup verification (one per row: drafter class, shared
modules, block size and auxiliary layers, model runner, KDA state ring, draft KV block). Each
compares what the drafter *recorded* (its checkpoint's fields, read before load into
``draft.ling_fields``) with what the loaded models *serve* (module identities, vLLM's speculative
config, the layers' KV-cache specs); none re-derives a choice. :func:`readings` returns them all,
:func:`optimization_entry` the report's ``dspark`` entry (behind
``vllm_ling:optimization_active{optimization="dspark"}``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

FIX_SHARING = ("the drafter must use the target's whole LM-head and embedding modules: serve it as "
               "LingDSparkModel through vllm-ling (never vLLM's Qwen3DSparkModel class with the FP8 head)")


@dataclasses.dataclass
class Reading:
    name: str
    passed: bool
    expected: str
    actual: str
    fix: str = ""


def read_drafter_class(draft) -> Reading:
    from vllm_ling.models.ling3_dspark import LingDSparkForCausalLM

    actual = type(draft).__name__ if draft is not None else "no drafter in this process"
    return Reading("dspark_drafter_class", isinstance(draft, LingDSparkForCausalLM),
                   "LingDSparkForCausalLM (vllm-ling's LingDSparkModel)", actual,
                   "vllm-ling's plugin did not register LingDSparkModel: check VLLM_PLUGINS allows vllm_ling")


def read_shared_modules(target, draft) -> Reading:
    """The drafter computes its base logits with the target's head *module* and embeds with the
    target's embedding module, holds no vocabulary-sized copy of either (its Markov tables are its
    own: [vocab, rank]), and its Markov projection is not the FP8 head's method."""
    from vllm_ling.models.ling3_mtp import TargetModuleSlot

    head, embed = target.lm_head, target.model.word_embeddings
    same_head, same_embed = draft.lm_head is head, draft.model.embed_tokens is embed
    slots = [n for n, m in draft.named_modules() if isinstance(m, TargetModuleSlot)]
    hidden = int(getattr(draft.config, "hidden_size", 0))
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    copies = [n for n, p in draft.named_parameters()
              if p.dim() == 2 and p.shape[-1] == hidden and p.shape[0] >= int(draft.config.vocab_size)
              and p.data_ptr() not in target_ptrs]
    markov_method = type(draft.model.markov_head.markov_w2.quant_method).__name__
    ok = same_head and same_embed and not slots and not copies and markov_method == "UnquantizedEmbeddingMethod"
    actual = (f"head {'is' if same_head else 'is NOT'} the target's module ({type(head.quant_method).__name__}); "
              f"embedding {'is' if same_embed else 'is NOT'} the target's; unshared slots {slots or 'none'}; "
              f"vocabulary-sized copies {copies[:3] or 'none'}; Markov projection {markov_method}")
    return Reading("dspark_shared_modules", ok,
                   "the target's head and embedding objects; no copies; BF16 Markov projection", actual, FIX_SHARING)


def read_block_size(vllm_config, target, draft) -> Reading:
    """Draft tokens within the drafter's trained block, and the target capturing exactly the layers
    the drafter was trained on (its ``target_layer_ids`` + 1)."""
    fields = draft.ling_fields
    spec = vllm_config.speculative_config
    tokens = int(spec.num_speculative_tokens)
    captured = tuple(getattr(target.model, "aux_hidden_state_layers", ()))
    ok = 1 <= tokens <= fields.block_size and captured == fields.aux_layers
    return Reading("dspark_block_size", ok,
                   f"<= {fields.block_size} draft tokens (block_size); target captures the input of layers "
                   f"{list(fields.aux_layers)} (target_layer_ids {list(fields.target_layer_ids)} + 1)",
                   f"{tokens} draft tokens, verify window {tokens + 1}; target captures {list(captured)}",
                   "use at most block_size draft tokens; vLLM's runner sets the captured layers from the drafter "
                   "config's target_layer_ids")


def read_runner(vllm_config) -> Reading:
    v2 = bool(vllm_config.use_v2_model_runner)
    return Reading("dspark_runner", v2, "Model Runner V2 (vLLM 0.32's only D-Spark runtime)",
                   "V2" if v2 else "V1", "unset VLLM_USE_V2_MODEL_RUNNER=0")


def _kda_layers(target) -> list[tuple[str, torch.nn.Module]]:
    from vllm.model_executor.layers.mamba.abstract import MambaBase

    return [(n, m) for n, m in target.named_modules() if isinstance(m, MambaBase)]


def read_kda_ring(vllm_config, target) -> Reading:
    """Every KDA layer keeps one recurrent state per verify position (``num_speculative_blocks``
    = draft tokens) and a conv window of ``W - 1 + draft tokens`` columns, so a verify window of
    ``block_size + 1`` tokens can roll back to any accepted prefix."""
    tokens = int(vllm_config.speculative_config.num_speculative_tokens)
    short = []
    layers = _kda_layers(target)
    for name, layer in layers:
        spec = layer.get_kv_cache_spec(vllm_config)
        conv_shape = tuple(spec.shapes[0])  # (columns, channels) or (channels, columns)
        if spec.num_speculative_blocks != tokens or layer.conv_size - 1 + tokens not in conv_shape:
            short.append(f"{name} ({spec.num_speculative_blocks} spec slots, conv {conv_shape})")
    ok = not short
    actual = ("no KDA layers (all-MLA target)" if not layers else
              f"{len(layers)} KDA layers, each {tokens} + 1 state slots and a {tokens}-token longer conv window"
              if ok else f"{len(layers)} KDA layers; short: {short[:3]}")
    return Reading("dspark_kda_ring", ok, f"{tokens + 1} recurrent states per request per KDA layer "
                   f"(verify window {tokens + 1})", actual,
                   "vLLM sizes the KDA state by num_speculative_tokens: report this with the vLLM version")


def read_draft_kv_block(vllm_config, draft) -> Reading:
    """Each draft attention layer reports the block vllm-ling sized (dspark_blocks) and its page fits
    the page the hybrid target's layers share."""
    from vllm_ling.models.dspark_blocks import BLOCK_ATTR, unified_page_bytes
    from vllm_ling.models.ling3 import LingForCausalLM

    page = unified_page_bytes(vllm_config, LingForCausalLM)
    rows = []
    for layer in draft.model.layers:
        attn = layer.self_attn.attn
        spec = attn.get_kv_cache_spec(vllm_config)
        rows.append((spec.block_size, getattr(attn, BLOCK_ATTR, None), spec.page_size_bytes))
    blocks = {r[0] for r in rows}
    ok = all(b == sized for b, sized, _ in rows) and (page is None or all(p <= page for _, _, p in rows))
    actual = (f"{len(rows)} draft layers, block {sorted(blocks)} tokens, page {rows[0][2] if rows else 0} B "
              f"of the shared {page} B" if rows else "no draft attention layer")
    return Reading("dspark_draft_kv_block", ok and bool(rows),
                   "draft KV block sized to fit the hybrid target's page", actual,
                   "the drafter's attention layers lost vllm-ling's block sizing: check the drafter class")


def readings(target, draft, vllm_config) -> list[Reading]:
    """Every DSpark row; a reader that raises is that row's failure (the others still run)."""
    readers: list[tuple[str, Callable[[], Reading]]] = [
        ("dspark_drafter_class", lambda: read_drafter_class(draft)),
        ("dspark_shared_modules", lambda: read_shared_modules(target, draft)),
        ("dspark_block_size", lambda: read_block_size(vllm_config, target, draft)),
        ("dspark_runner", lambda: read_runner(vllm_config)),
        ("dspark_kda_ring", lambda: read_kda_ring(vllm_config, target)),
        ("dspark_draft_kv_block", lambda: read_draft_kv_block(vllm_config, draft)),
    ]
    out = []
    for name, read in readers:
        try:
            out.append(read())
        except Exception as exc:  # noqa: BLE001 - a defect in what is read is that row's failure
            out.append(Reading(name, False, "the reading completes", f"it raised {type(exc).__name__}: {exc}",
                               "report the message"))
    return out


def optimization_entry(requested: bool, rows: list[Reading]) -> dict[str, Any]:
    """The report's ``dspark`` optimization: active when every DSpark row passed."""
    failed = [r.name for r in rows if not r.passed]
    detail = ("not requested" if not requested else
              "; ".join(r.actual for r in rows if r.name in ("dspark_shared_modules", "dspark_block_size"))
              if not failed else f"failed: {', '.join(failed)}")
    return {"requested": requested, "active": requested and bool(rows) and not failed, "detail": detail}
