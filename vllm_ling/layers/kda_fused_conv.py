"""Ling-3.0's KDA short convolutions as one launch per layer (CUDA), and its prefill without a host sync.

vLLM 0.32's KDA runs its causal convolution three times per layer, for q, k and v, each over its own
third of the layer's conv state (``conv_state.chunk(3)``): 105 launches of 2.7 us in the real H100
decode step (``benchmarks/results/step_profile_real_h100.md``). The convolution is depthwise, and q,
k, v are adjacent columns of the merged in-projection's output and adjacent channel blocks of the
state, so one launch over the [tokens, 3 P] view with the three weights as one [3 P, W] tensor
computes exactly the three.

vLLM's prefill also zeroes the state of each new sequence through a boolean-mask index
(``state_indices[~has_initial_state]``): a ``nonzero``, so one host sync per KDA layer and prefill
step, which drains the GPU's queue and leaves the next kernels' launch time exposed (33 syncs in a
1920-token step of the real H100 prefill, ``benchmarks/results/prefill_profile_h100.md``). Here a
new sequence's initial recurrent state is a ``torch.where`` on the gathered states instead: the same
values, no sync.

- The weights: :func:`fuse_conv_weights` (at construction, before loading) makes the three conv
  weight parameters views of one buffer, so the checkpoint loads into it and nothing is copied.
- The forward: :func:`kda_attention` behind the opaque op ``vllm_ling::kda_attention`` (a graph
  splitting point, as vLLM's ``bailing_v3_kda_attention``), taking the [tokens, 3 P] view. A batch of
  plain decodes, of speculative verify windows, or of prefills (with decodes, without speculation)
  runs the fused conv and then vLLM's recurrent or chunked KDA kernel with vLLM's arguments; a batch
  mixing verify windows with prefills goes to vLLM's ``_forward`` unchanged. vLLM's kernels are looked
  up on vLLM's model module at call time, as its forward does.
- The op writes its result into the caller's ``core_attn_out``, which the compiled code allocated
  before it, and returns nothing, as every vLLM splitting op does: a piecewise CUDA graph replays
  the addresses its inputs had at capture, so a tensor the eager op allocated and returned would be
  read from where the capture's one was (lease 2026-12-06e: the tiny MTP server's first verify
  drafted a token outside the vocabulary after prefills served that way).

The layer records its selection (:func:`~vllm_ling.models.kda_fused_conv.select_kda_fused_conv`);
:data:`READER` reads back whether its weights are the views and its forward the fused one, and the
known answers run :func:`short_conv` on a scratch state (:mod:`vllm_ling.ops.known_answer.kda_conv`).
"""

from __future__ import annotations

import torch

from vllm_ling.models.kda_merged_in_proj import MERGED_NAME
from vllm_ling.models.layer_kinds import is_kda_module, kda_layers
from vllm_ling.layers.selection_said import say_selection
from vllm_ling.log import get_logger
from vllm_ling.models.kda_fused_conv import FUSED_DESCRIPTION, OPTION, WEIGHT_ATTR, KdaConv, select_kda_fused_conv
from vllm_ling.ops.known_answer.kda_conv import ConvCall
from vllm_ling.options import LingOptions, opt_out_setting
from vllm_ling.selection import Feature, Platform, Reader, Selection, Served, record

logger = get_logger("kda")

OP_NAME = "vllm_ling::kda_attention"
KERNEL_LABEL = "vLLM's causal_conv1d_update / causal_conv1d_fn over q, k and v in one launch"
_CONVS = ("q_conv1d", "k_conv1d", "v_conv1d")


def conv_problems(layer) -> list[str]:
    """Why the layer's three convolutions cannot share one weight (empty when they can)."""
    convs = [getattr(layer, name, None) for name in _CONVS]
    if any(c is None for c in convs):
        return ["the layer has no q, k and v conv1d modules"]
    problems = []
    if any(c.bias is not None for c in convs):
        problems.append("a conv has a bias")
    shapes = {(tuple(c.weight.shape), c.weight.dtype, c.weight.device) for c in convs}
    if len(shapes) != 1:
        problems.append(f"the convs' weights differ in shape, dtype or device ({sorted(map(str, shapes))})")
    elif convs[0].weight.dim() != 3 or convs[0].weight.shape[1] != 1:
        problems.append(f"conv weight of shape {tuple(convs[0].weight.shape)}, not [channels, 1, width]")
    return problems


def decide(layer, merged_in_proj: bool, platform: Platform) -> Selection:
    """The layer's selection, said once (:func:`~vllm_ling.layers.selection_said.say_selection`): where the
    in-projection is not merged, that switch's WARNING says it, not a second one claiming this opt-out."""
    enabled = LingOptions.current().kda_fused_conv
    selection = select_kda_fused_conv(enabled, platform, merged_in_proj, conv_problems(layer))
    return say_selection(
        logger, "kda-fused-conv", selection, selection.choice is KdaConv.FUSED, enabled, platform,
        f"KDA short convolutions: {FUSED_DESCRIPTION}.",
        f"KDA fused convolutions are OFF by explicit choice ({opt_out_setting(OPTION)}): vLLM's KDA forward, three "
        "conv launches per layer and a host sync per layer at prefill; the startup report marks kda_fused_conv "
        "inactive.",
        f"KDA fused convolutions off for {layer.prefix} and similar layers: {{reason}}; vLLM's three launches serve "
        "them (the startup check kda_fused_conv reports it).")


def fuse_conv_weights(layer) -> torch.Tensor:
    """Make the q, k and v conv weights ([P, 1, W] each) views of one [3 P, 1, W] buffer (before
    loading: the loaders copy into the views) and return it as the [3 P, W] weight."""
    convs = [getattr(layer, name) for name in _CONVS]
    first = convs[0].weight
    buffer = torch.empty((len(convs) * first.shape[0], *first.shape[1:]), dtype=first.dtype, device=first.device)
    for i, conv in enumerate(convs):
        conv.weight.data = buffer[i * first.shape[0]:(i + 1) * first.shape[0]]
    return buffer.view(buffer.shape[0], buffer.shape[2])


def install(layer, merged_in_proj: bool, platform: Platform) -> Selection:
    """Decide, record, and for the fused path fuse the weights and make the op a splitting point."""
    selection = record(layer, decide(layer, merged_in_proj, platform))
    setattr(layer, WEIGHT_ATTR, fuse_conv_weights(layer) if selection.choice is KdaConv.FUSED else None)
    if selection.choice is KdaConv.FUSED:
        from vllm.config import get_current_vllm_config

        splitting = get_current_vllm_config().compilation_config.splitting_ops
        if splitting is not None and OP_NAME not in splitting:
            splitting.append(OP_NAME)
    return selection


def conv_update(call: ConvCall) -> torch.Tensor:
    """The fused update: vLLM's ``causal_conv1d_update`` as its decode and verify-window paths call it,
    on all three blocks, into a new [n, 3 P] tensor (returned; ``call.x`` is left as it was, so the op
    mutates no input); ``call.state`` in place."""
    from vllm.model_executor.models import bailing_moe_v3 as vllm_model

    out = torch.empty(call.x.shape, dtype=call.x.dtype, device=call.x.device)
    if call.cu_seqlens is None:
        vllm_model.causal_conv1d_update(call.x, call.state, call.weight, None, activation="silu",
                                        conv_state_indices=call.indices, validate_data=True, out=out)
    else:
        vllm_model.causal_conv1d_update(call.x, call.state, call.weight, None, activation="silu",
                                        conv_state_indices=call.indices, num_accepted_tokens=call.accepted,
                                        query_start_loc=call.cu_seqlens, max_query_len=call.max_len,
                                        validate_data=False, out=out)
    return out


def conv_prefill(call: ConvCall) -> torch.Tensor:
    """The fused prefill conv: vLLM's ``causal_conv1d_fn`` as its prefill path calls it (channel-last
    [3 P, tokens] views), on all three blocks, into a new [n, 3 P] tensor; ``call.state`` in place.
    ``call.metadata``: vLLM's precomputed launch grid (None: the kernel derives it, with a host copy)."""
    from vllm.model_executor.models import bailing_moe_v3 as vllm_model

    return vllm_model.causal_conv1d_fn(call.x.transpose(0, 1), call.weight, None, activation="silu",
                                       conv_states=call.state, has_initial_state=call.initial,
                                       cache_indices=call.indices, query_start_loc=call.cu_seqlens,
                                       metadata=call.metadata).transpose(0, 1)


def short_conv(call: ConvCall) -> torch.Tensor:
    """The fused conv the layer runs for ``call``: a prefill's (``call.initial`` given) or an update's."""
    return conv_prefill(call) if call.initial is not None else conv_update(call)


def _heads(layer, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """q, k, v of the [n, 3 P] conv output as [1, n, heads, head_dim] views."""
    return tuple(t.unflatten(-1, (-1, layer.head_dim)).unsqueeze(0)
                 for t in x.split(layer.projection_size_per_partition, dim=-1))


def gate_and_beta(layer, f: torch.Tensor, beta_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(g [1, tokens, heads, head_dim] float32, beta [1, tokens, heads] float32) as vLLM's forward computes
    them: its ``fused_kda_gate`` kernel (looked up on vLLM's model module, as its forward does; rows packed)
    and a sigmoid."""
    from vllm.model_executor.models import bailing_moe_v3 as vllm_model

    g = vllm_model.fused_kda_gate(f.contiguous(), layer.A_log, layer.head_dim, g_bias=layer.dt_bias,
                                  lower_bound=layer.lower_bound if layer.safe_gate else None)
    return g.unsqueeze(0), beta_logits.float().sigmoid().unsqueeze(0)


def kda_attention(layer, qkv: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, g: torch.Tensor,
                  core_attn_out: torch.Tensor) -> None:
    """The layer's KDA core for one step into ``core_attn_out`` [1, tokens, heads, head_dim] (rows past
    the batch's tokens, CUDA-graph padding, zero), from the rows' conv inputs ``qkv`` [tokens, 3 P], raw
    gate projection ``f`` [tokens, P] and beta logits [tokens, heads]: the layer's one-launch decode
    (:mod:`vllm_ling.layers.kda_decode`, where it serves) or the fused conv and vLLM's recurrent kernels
    for batches of plain decodes or of verify windows only, the fused conv and vLLM's chunked kernel for
    prefills with decodes and no verify window, vLLM's ``_forward`` for the rest. Where the layer's output
    norm is vllm-ling's (:mod:`vllm_ling.layers.kda_output_norm`) the rows come back normed with the output
    gate projection ``g`` [tokens, P]: inside the one launch, else by vLLM's norm kernel here."""
    from vllm.forward_context import get_forward_context
    from vllm.model_executor.layers.mamba.mamba_utils import is_conv_state_dim_first
    from vllm.model_executor.models import bailing_moe_v3 as vllm_model

    from vllm_ling.layers import kda_decode, kda_output_norm

    metadata = get_forward_context().attn_metadata  # {layer name: metadata}, as vLLM's forward asserts
    md = None if metadata is None else metadata.get(layer.prefix)
    decode_only = md is not None and md.spec_sequence_masks is None and md.num_prefills == 0 and md.num_decodes > 0
    verify_only = (md is not None and md.spec_sequence_masks is not None and md.num_prefills == 0
                   and md.num_decodes == 0)
    with_prefill = md is not None and md.spec_sequence_masks is None and md.num_prefills > 0
    if not (decode_only or verify_only or with_prefill):
        # profile / warm-up runs carry no mamba metadata (vLLM's forward leaves the zeros too)
        core_attn_out.zero_()
        if md is not None:
            q, k, v = qkv.split(layer.projection_size_per_partition, dim=-1)
            layer._forward(q, k, v, *gate_and_beta(layer, f, beta_logits), core_attn_out)
            if kda_output_norm.active(layer):  # the padding's zero rows stay zero
                core_attn_out[0].copy_(kda_output_norm.normed(layer, core_attn_out[0], g))
        return
    conv_state, recurrent_state = layer.kv_cache
    recurrent_state = recurrent_state[..., :layer.head_dim]
    if not is_conv_state_dim_first():
        conv_state = conv_state.transpose(-1, -2)
    n = md.num_actual_tokens
    x, f, beta_logits = qkv[:n], f[:n], beta_logits[:n]
    weight = getattr(layer, WEIGHT_ATTR)
    if n < core_attn_out.shape[1]:
        core_attn_out[0, n:].zero_()
    norm = kda_output_norm.active(layer)
    if getattr(layer, kda_decode.ACTIVE_ATTR, False) and not with_prefill:
        kda_decode.step(layer, md, x, f, beta_logits, conv_state, recurrent_state, weight, core_attn_out[0, :n],
                        verify=verify_only, output_norm=kda_output_norm.output_norm(layer, g[:n]) if norm else None)
        return
    rows = _core(layer, md, x, f, beta_logits, conv_state, recurrent_state, weight, n, with_prefill, decode_only)
    # one copy into the caller's buffer: the normed rows where the op applies the norm
    core_attn_out[0, :n].copy_(kda_output_norm.normed(layer, rows, g[:n]) if norm else rows)


def _core(layer, md, x: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, conv_state: torch.Tensor,
          recurrent_state: torch.Tensor, weight: torch.Tensor, n: int, with_prefill: bool,
          decode_only: bool) -> torch.Tensor:
    """The fused conv and vLLM's kernels (see :func:`kda_attention`): the core's rows [n, heads, head_dim]."""
    from vllm.model_executor.models import bailing_moe_v3 as vllm_model

    if with_prefill:  # vLLM's chunked path, which takes the batch's decodes along (has_initial_state True)
        from vllm.third_party.flash_linear_attention.ops import kda as fla_kda

        slots, cu, initial = md.non_spec_state_indices_tensor, md.non_spec_query_start_loc, md.has_initial_state
        x = conv_prefill(ConvCall(x, conv_state, weight, slots, cu_seqlens=cu, initial=initial, metadata=md))
        q, k, v = (t.contiguous() for t in _heads(layer, x))
        # a new sequence starts from zeros: selected, not zeroed in the pool through a mask index (a sync);
        # its pool row is overwritten with its final state below either way
        start = torch.where(initial[:, None, None, None], recurrent_state[slots], 0)
        # the gate inside the chunk cumsum (vLLM's Kimi path, looked up on the module at call time): the
        # gate formula of fused_kda_gate without its own launch, which from this eager op would cost a
        # Python-side Triton launch per layer (lease 2026-12-06g: TTFT +6% at 32K)
        out, final = fla_kda.chunk_kda_with_fused_gate(
            q=q, k=k, v=v, raw_g=f.unflatten(-1, (-1, layer.head_dim)).unsqueeze(0),
            beta=beta_logits.float().sigmoid().unsqueeze(0), A_log=layer.A_log, g_bias=layer.dt_bias,
            initial_state=start, output_final_state=True, lower_bound=layer.lower_bound if layer.safe_gate else None,
            use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
        recurrent_state[slots] = final
        return out[0, :n]
    g1, beta = gate_and_beta(layer, f, beta_logits)
    if decode_only:
        slots = md.non_spec_state_indices_tensor
        q, k, v = _heads(layer, conv_update(ConvCall(x, conv_state, weight, slots[:n])))
        out, _ = vllm_model.fused_recurrent_kda(
            q=q, k=k, v=v, g=g1, beta=beta, initial_state=recurrent_state, use_qk_l2norm_in_kernel=True,
            safe_gate=layer.safe_gate, lower_bound=layer.lower_bound,
            cu_seqlens=md.non_spec_query_start_loc[:md.num_decodes + 1], ssm_state_indices=slots)
    else:
        slots, cu = md.spec_state_indices_tensor, md.spec_query_start_loc
        x = conv_update(ConvCall(x, conv_state, weight, slots[:, 0][:md.num_spec_decodes], cu_seqlens=cu,
                                 accepted=md.num_accepted_tokens, max_len=slots.size(-1)))
        q, k, v = (t.contiguous() for t in _heads(layer, x))
        out, _ = vllm_model.fused_recurrent_kda_fwd(
            q=q, k=k, v=v, g=g1.contiguous(), beta=beta.contiguous(), scale=layer.head_dim ** -0.5,
            initial_state=recurrent_state, inplace_final_state=True, cu_seqlens=cu[:md.num_spec_decodes + 1],
            ssm_state_indices=slots, num_accepted_tokens=md.num_accepted_tokens, use_qk_l2norm_in_kernel=True)
    return out[0, :n]


def _kda_attention_op(qkv: torch.Tensor, f: torch.Tensor, beta_logits: torch.Tensor, g: torch.Tensor,
                      core_attn_out: torch.Tensor, layer_name: str) -> None:
    from vllm.forward_context import get_forward_context

    kda_attention(get_forward_context().no_compile_layers[layer_name], qkv, f, beta_logits, g, core_attn_out)


# writes core_attn_out only (the caller's buffer: a piecewise graph's next piece reads it where the capture
# did); the conv's outputs go to a new tensor (vLLM's op writes them into its q, k and v inputs undeclared)
kda_attention_op = torch.library.custom_op(OP_NAME, _kda_attention_op, mutates_args=("core_attn_out",))


def served(layer) -> Served:
    """What a KDA layer's convolutions are at decode, read from the layer: fused where its forward
    takes the fused op (the merged in-projection's) and its three weights are views of the fused one."""
    weight = getattr(layer, WEIGHT_ATTR, None)
    if weight is None:
        return Served.of(KdaConv.SEPARATE)
    convs = [getattr(layer, name).weight for name in _CONVS]
    step = convs[0].shape[0] * convs[0].shape[-1] * convs[0].element_size()
    views = all(c.data_ptr() == weight.data_ptr() + i * step for i, c in enumerate(convs))
    if not views or weight.shape[0] != sum(c.shape[0] for c in convs):
        return Served.of(None, label="a fused conv weight the q, k and v convs do not load into")
    if getattr(layer, MERGED_NAME, None) is None:
        return Served.of(None, label="a fused conv weight on a layer without the merged in-projection")
    return Served.of(KdaConv.FUSED)


READER = Reader(
    Feature.KDA_FUSED_CONV, "kda_fused_conv", "KDA layers' convolutions", is_kda_module, served,
    f"see the WARNING naming the layer, or set {opt_out_setting(OPTION)}; a layer serving other than its "
    "selection is a defect: report it",
    expected=kda_layers, optimization="kda_fused_conv", optimizing=frozenset({KdaConv.FUSED}),
    known_answers="kda_conv")
