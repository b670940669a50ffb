"""Ling-3.0 NEXTN (MTP) draft that uses the target's head and embedding *modules*.

vLLM builds the draft with its own ``ParallelLMHead`` per NEXTN layer and its own
embedding, loads the checkpoint's BF16 head and embedding into them, and only afterwards
(in the V1 proposer's ``_maybe_share_lm_head`` / the V2 runner's ``load_eagle_model``, or
through ``share_lm_head``) replaces them with the target's. With the FP8 head, a draft
that ends up with anything but the target's module reads FP8 bytes without their
scales/kernel and acceptance collapses ("the trap" of the DGX Spark study).

This class therefore never owns a head or an embedding: both are :class:`TargetModuleSlot`
placeholders that hold no storage and raise if used before the target's module is put
in their place. Whatever runner path does the sharing, the result is checked by the
startup verification (``vllm_ling.runtime.verification``): same objects, no duplicate
storage, or the server refuses to start.
"""

from __future__ import annotations

import torch
from torch import nn
from vllm.config import VllmConfig
from vllm.model_executor.models.bailing_moe_v3_mtp import BailingMoeV3MTPModel

from vllm_ling.models import loaded


class DraftModuleNotShared(RuntimeError):
    pass


class TargetModuleSlot(nn.Module):
    """Stands where the draft's head / embedding would be until the target's is shared."""

    def __init__(self, what: str):
        super().__init__()
        self.what = what

    def forward(self, *args, **kwargs):
        raise DraftModuleNotShared(
            f"the NEXTN draft used its {self.what} before vLLM shared the target's module; "
            "vllm-ling refuses to run a draft with its own copy (see the FP8-head trap)")


class LingMTPModel(BailingMoeV3MTPModel):
    """The Ling-3.0 NEXTN draft as registered by vllm-ling."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        from vllm_ling.models.ling3 import check_local_checkpoint

        check_local_checkpoint(vllm_config, include_mtp=True)
        super().__init__(vllm_config=vllm_config, prefix=prefix)
        # Free the copies vLLM's MTP layer builds; the target's modules take their place.
        self.model.embed_tokens = TargetModuleSlot("embedding")
        for layer in self.model.layers.values():
            layer.shared_head.head = TargetModuleSlot("LM head")
        self.ling_sharing_path: str | None = None
        loaded.remember("draft", self)

    def share_lm_head(self, lm_head: nn.Module) -> None:
        """vLLM's explicit sharing hook: share with every NEXTN layer, not only ``lm_head``."""
        super().share_lm_head(lm_head)
        for layer in self.model.layers.values():
            layer.shared_head.head = lm_head
        self.ling_sharing_path = "share_lm_head()"

    def heads(self) -> list[nn.Module]:
        """Every head module the draft can compute logits with."""
        heads = [layer.shared_head.head for layer in self.model.layers.values()]
        if self.lm_head is not None:
            heads.append(self.lm_head)
        return heads


def build_weight_only_trap(target_head: nn.Module) -> nn.Module:
    """Negative control: the upstream trap, on purpose. A separate unquantized head whose
    BF16 weight is the target's FP8 *bytes* read as BF16 (each pair of e4m3 bytes taken as
    one bfloat16; non-finite values zeroed), which is what a draft that shares only the
    weight tensor of an FP8 head computes with. Used when
    ``VLLM_LING_NEGATIVE_CONTROL=weight_only_head``; the startup verification rejects it."""
    from vllm.model_executor.layers.vocab_parallel_embedding import UnquantizedEmbeddingMethod

    trap = nn.Module()
    raw = target_head.weight.data.contiguous().view(torch.uint8)  # [V, H] FP8 bytes
    as_bf16 = torch.cat([raw, raw], dim=1).view(torch.bfloat16)  # [V, H] bytes reinterpreted
    trap.weight = nn.Parameter(torch.nan_to_num(as_bf16, nan=0.0, posinf=0.0, neginf=0.0),
                               requires_grad=False)
    trap.quant_method = UnquantizedEmbeddingMethod()
    for attr in ("org_vocab_size", "num_embeddings", "num_embeddings_padded", "shard_indices",
                 "tp_size", "embedding_dim", "bias"):
        if hasattr(target_head, attr):
            setattr(trap, attr, getattr(target_head, attr))
    trap.quant_method.process_weights_after_loading(trap)  # platform GEMM dispatch, as vLLM does
    return trap
