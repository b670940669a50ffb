"""Patch P13: a Ling target's CUDA graph sizes reach its prefill chunks.

What: wraps ``VllmConfig._set_cudagraph_sizes``: after vLLM computed its capture sizes (its decode
sizes included), :func:`vllm_ling.runtime.prefill_graphs.add_prefill_sizes` adds a ladder of
prefill sizes above them, up to ``VLLM_LING_PREFILL_GRAPH_TOKENS`` (at most
``max_num_batched_tokens``), unless the user gave sizes in ``--compilation-config``, opted out, or
vLLM captures no graphs. The decision is recorded on the target's hf_config for the startup
verification.
Why: vLLM sizes its graphs for decode batches only, and a model's config hook (P4) runs before
vLLM computes them: setting ``max_cudagraph_capture_size`` there would replace vLLM's decode sizes
(a DSpark verify window of 9 tokens is on no grid) instead of adding to them. Prefill steps outside
graphs are host-bound (``benchmarks/results/prefill_profile_h100.md``). Registry record:
``registry.PATCHES``.
"""

from __future__ import annotations

_MARK = "_vllm_ling_prefill_graph_sizes"


def _vllm_config_cls():
    from vllm.config import VllmConfig

    return VllmConfig


def is_applied() -> bool:
    return getattr(_vllm_config_cls().__dict__.get("_set_cudagraph_sizes"), _MARK, False)


def apply() -> None:
    from vllm_ling.patches.config_hooks import is_ling_target
    from vllm_ling.runtime.prefill_graphs import add_prefill_sizes, recorded_prefill_graphs

    cls = _vllm_config_cls()
    original = cls._set_cudagraph_sizes

    def _set_cudagraph_sizes(self):
        compilation = self.compilation_config
        # given by the user (a second __post_init__ of the same config sees its own earlier sizes: the
        # decision recorded then stands)
        user_gave = (compilation.cudagraph_capture_sizes is not None
                     or compilation.max_cudagraph_capture_size is not None)
        original(self)
        model_config = self.model_config
        if (model_config is not None and is_ling_target(model_config)
                and recorded_prefill_graphs(model_config.hf_config) is None):
            add_prefill_sizes(self, user_gave)

    _set_cudagraph_sizes.__wrapped__ = original
    setattr(_set_cudagraph_sizes, _MARK, True)
    cls._set_cudagraph_sizes = _set_cudagraph_sizes
