"""The layers vllm-ling's custom ops find by name (``vllm_ling::dense_fp8_linear``,
``small_bf16_linear``, ``router_logits``), as vLLM's own layer ops take a layer name.

The name is an argument of the op, so torch.compile bakes it into the graph, and vLLM 0.32 on
torch >= 2.10 saves that graph (``VLLM_USE_AOT_COMPILE``, on by default) and loads it on the
next start of the same model and config. A name must therefore come out the same in a fresh
process: it is the layer's prefix (unique within a model), suffixed ``#2``, ``#3``... only where
another live layer holds it (e.g. a known-answer check's scratch layer, built after the served
ones). Weak references: a rebuilt model's old layers neither stay alive nor keep their names.
"""

from __future__ import annotations

import weakref

import torch


class LayersByName(weakref.WeakValueDictionary):
    def register(self, layer: torch.nn.Module, prefix: str, fallback: str) -> str:
        """The op's name for ``layer`` (``fallback`` where the prefix is empty); the same layer
        registered again keeps its name."""
        base = prefix or fallback
        key, n = base, 1
        while self.get(key) not in (None, layer):
            n += 1
            key = f"{base}#{n}"
        self[key] = layer
        return key
