"""Patch P12: vLLM's Ling model returns the auxiliary hidden states DSpark reads.

What: ``vllm.model_executor.models.bailing_moe_v3.BailingMoeV3Model`` becomes
:class:`vllm_ling.models.ling3.LingModel` (a subclass: vLLM's loop plus the capture of
``EagleModelMixin``), so ``BailingMoeV3ForCausalLM.__init__`` (inherited by vllm-ling's
``LingForCausalLM``) builds it.
Why: vLLM 0.32's ``BailingMoeV3Model`` captures no auxiliary hidden states, and its causal-LM
constructor names the model class directly (no factory to override); building vLLM's model and
then a second one would allocate every target weight twice. With no layers set the output is
vLLM's. Registry record: ``registry.PATCHES``.
"""

from __future__ import annotations


def _module():
    from vllm.model_executor.models import bailing_moe_v3

    return bailing_moe_v3


def _ours():
    from vllm_ling.models.ling3 import LingModel

    return LingModel


def is_applied() -> bool:
    return _module().BailingMoeV3Model is _ours()


def apply() -> None:
    _module().BailingMoeV3Model = _ours()
