"""The draft's head(s) and embedding are the target's module objects, and the draft holds no
vocabulary-sized storage of its own (the FP8-head trap: a draft sharing the weight tensor only).
Both drafts vllm-ling loads share so: the NEXTN draft (MTP) and the DSpark drafter, whose Markov
tables ([vocabulary, rank]) are its own."""

from __future__ import annotations

import torch

from vllm_ling.runtime.verification.checks import Check
from vllm_ling.runtime.verification.speculative import Speculative
from vllm_ling.runtime.verification.stage import Stage
from vllm_ling.selection import DRAFT_SHARING_ROW as CHECK_NAME


def _vocab_rows(module: torch.nn.Module) -> int:
    """Vocabulary rows of a (vocab-parallel) embedding or head on this rank, padding included."""
    rows = getattr(module, "num_embeddings_per_partition", None)
    return int(rows) if rows is not None else int(module.weight.shape[0])


def own_storage_bytes(draft: torch.nn.Module, target: torch.nn.Module) -> int:
    """Bytes of draft parameters whose storage the target does not hold (each storage once)."""
    target_ptrs = {p.data_ptr() for p in target.parameters()}
    own = {p.data_ptr(): p.numel() * p.element_size() for p in draft.parameters() if p.data_ptr() not in target_ptrs}
    return sum(own.values())


def check_draft_sharing(target, draft, spec: Speculative, stage: Stage | None = None) -> Check:
    if stage is not None and not stage.is_last and draft is None:
        return Check(CHECK_NAME, True, f"no draft on {stage.label()}: vLLM runs it on the last stage", "no draft here")
    if spec.method is None:
        return Check(CHECK_NAME, True, "no draft (speculation off)", "no draft")
    if not spec.draft_model:
        return Check(CHECK_NAME, True, f"no draft model (--speculative-config method {spec.method})",
                     "no draft model" if draft is None else f"draft {type(draft).__name__}")
    kind = "DSpark drafter" if spec.dspark else "NEXTN draft"
    if draft is None:
        return Check(CHECK_NAME, False, "draft loaded", f"no {kind} in this process",
                     f"the speculative config names no Ling {kind}")
    heads = draft.heads() if hasattr(draft, "heads") else [draft.lm_head]  # vLLM's own draft classes: one head
    same_head = all(h is target.lm_head for h in heads)
    target_embed = target.model.word_embeddings
    # vLLM shares the embedding with the draft only without pipeline parallelism: on a later
    # stage the target has none (PPMissingLayer) and the draft keeps its own, as vLLM intends
    embed_here = hasattr(target_embed, "weight")
    same_embed = draft.model.embed_tokens is target_embed if embed_here else True
    own = own_storage_bytes(draft, target)
    head_bytes = target.lm_head.weight.numel() * target.lm_head.weight.element_size()
    # A duplicate head or embedding is a [vocab rows, hidden] tensor the target does not own. The rows
    # are the modules' logical vocabulary: a GPU head kernel's repacked weight has other dimensions
    # (humming's FP8 head is [hidden / 16, ...]: on the tiny model 16 rows, as many as its experts);
    # the DSpark drafter's Markov tables are [vocab rows, rank], its own by design.
    vocab_rows = {_vocab_rows(target.lm_head)} | ({_vocab_rows(target_embed)} if embed_here else set())
    hidden = int(target.config.hidden_size)
    target_ptrs = {q.data_ptr() for q in target.parameters()}
    draft_embed = getattr(draft.model.embed_tokens, "weight", None)
    big_own = [n for n, p in draft.named_parameters()
               if p.dim() == 2 and p.shape[0] in vocab_rows and p.shape[1] == hidden
               and p.data_ptr() not in target_ptrs and (embed_here or p is not draft_embed)]
    path = draft.ling_sharing_path or "vLLM proposer module sharing"
    embed_text = (f"embedding {'is' if same_embed else 'is NOT'} the target's" if embed_here else
                  "embedding is the draft's own (the target's is on the first pipeline stage)")
    actual = (f"{len(heads)} head ref(s) {'are' if same_head else 'are NOT all'} the target's module; "
              f"{embed_text}; draft-only storage {own} bytes (head {head_bytes} bytes); path: {path}")
    if big_own:
        actual += f"; duplicate vocabulary-sized tensors in the draft: {big_own[:3]}"
    return Check(CHECK_NAME, same_head and same_embed and not big_own,
                 "draft head(s) and embedding are the target's objects; no duplicate storage", actual,
                 "the draft must share the target's whole head module (weights, scales, method); "
                 "do not share only the weight tensor")
