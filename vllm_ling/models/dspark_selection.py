"""The drafter feature (:attr:`~vllm_ling.selection.Feature.DRAFTER`): what a DSpark drafter records
when vLLM builds it, and the words its reader uses for what it serves.

The choice is made once, by patch P5 (``runtime.spec_policy.select_speculation``: the DSpark drafter
when ``VLLM_LING_DSPARK_MODEL`` is given) or by the user's ``--speculative-config`` method
``dspark``; vLLM's speculative config then gives the drafter its draft tokens (the checkpoint's
``block_size`` unless the user set fewer). The drafter records that choice on itself with what it
implies for the runtime (:func:`dspark_selection`); its reader
(:mod:`vllm_ling.layers.dspark_drafter`) reads the same facts back from the loaded models, in the
same words (the switches below), so the startup verification compares the two.
"""

from __future__ import annotations

import dataclasses

from vllm_ling.models.names import SPECULATION_ATTR
from vllm_ling.options import Drafter
from vllm_ling.selection import Feature, Selection

RUNNER_V2 = "Model Runner V2"  # vLLM 0.32 runs D-Spark only here (its V1 runner refuses the method)
RUNNER_V1 = "Model Runner V1"
PAGES_FIT = "draft KV pages within the hybrid page"  # the page every layer of the hybrid target shares
MARKOV_BF16 = "BF16 Markov projection"  # vLLM's Markov gather reads the weight itself: never the FP8 head's method


def tokens_switch(draft_tokens: int) -> str:
    return f"{draft_tokens} draft tokens per block"


def layers_switch(layers: tuple[int, ...]) -> str:
    """The target layers whose input the drafter reads (vLLM numbers the capture points so)."""
    return f"target layers {list(layers)}"


def kda_switch(verify_window: int | None) -> str:
    """The verify window every KDA layer's state can roll back (None: the target has no KDA layer)."""
    return "no KDA state" if verify_window is None else f"KDA state for a {verify_window}-token verify window"


@dataclasses.dataclass(frozen=True)
class DrafterSelection(Selection):
    """A DSpark drafter (``choice``: :attr:`Drafter.DSPARK`) with the block vLLM gave it, the target
    layers its checkpoint was trained on and the KDA window a verify of that block needs."""

    draft_tokens: int = 0
    target_layers: tuple[int, ...] = ()
    kda_window: int | None = None

    def served_as(self) -> tuple:
        """What a drafter serving this selection shows: compared with
        :func:`vllm_ling.layers.dspark_drafter.served` of the loaded drafter."""
        return (self.choice, tokens_switch(self.draft_tokens), layers_switch(self.target_layers), RUNNER_V2,
                kda_switch(self.kda_window), PAGES_FIT, MARKOV_BF16)


def dspark_selection(target_hf_config, draft_tokens: int, block_size: int, target_layers: tuple[int, ...],
                     has_kda: bool) -> DrafterSelection:
    """What the drafter records: the choice P5 recorded on the target's config (its reason), the
    ``draft_tokens`` vLLM's speculative config gives it and the verify window that block needs."""
    speculation = getattr(target_hf_config, SPECULATION_ATTR, None) or {}
    reason = speculation.get("reason") or "--speculative-config method dspark"
    return DrafterSelection(Feature.DRAFTER, Drafter.DSPARK,
                            f"{reason}; {draft_tokens} draft tokens of its block_size {block_size}",
                            draft_tokens=draft_tokens, target_layers=tuple(target_layers),
                            kda_window=draft_tokens + 1 if has_kda else None)
