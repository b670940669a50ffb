"""The CPU KDA layer inside real vLLM machinery: vLLM's own layer constructor (through the
out-of-tree mechanism), its state cache bound from raw pages by ``bind_kv_cache``, metadata
from vLLM's ``GDNAttentionMetadataBuilder.build`` and the forward context.

Reference: the same layer's projection modules composed with vllm_ling.ops.kda in its
*recurrent* form over each whole sequence from a zero state (the layer uses the chunked
form for prefill and the pooled state cache); ops.kda itself is checked against a naive
loop in tests/ops/test_kda.py. float32 comparisons use 2e-4 (float32 chunked vs
recurrent over <= 40 tokens agrees to ~1e-5; a wrong state hand-over gives errors of
order 1e-1); bfloat16 continuity uses 3e-2 (bf16 output rounding).

The merged in-projection (vllm_ling.layers.kda_merged_in_proj) is checked against vLLM's three
linears on the same block-FP8 weights: the CPU layer through real metadata, the vLLM-kernel
layer (every other platform) with stand-ins for its Triton kernels; both to 1e-5 in fp32.
"""

from __future__ import annotations

import collections
import itertools
import types

import pytest
import torch

vllm = pytest.importorskip("vllm")

from vllm.platforms import current_platform  # noqa: E402

from vllm_ling.launcher.local_server import free_port  # noqa: E402

pytestmark = pytest.mark.skipif(not current_platform.is_cpu(),
                                reason="the plain-PyTorch KDA layer is installed only on CPU")

HIDDEN, HEADS, HEAD_DIM, CONV = 256, 16, 64, 4  # the tiny Ling config's KDA shape
SLOTS = 8
_prefix_ids = itertools.count()


@pytest.fixture(scope="module")
def vllm_config():
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    config = VllmConfig()
    owns_process_group = not torch.distributed.is_initialized()
    with set_current_vllm_config(config):
        if owns_process_group:
            port = free_port()
            init_distributed_environment(world_size=1, rank=0,
                                         distributed_init_method=f"tcp://127.0.0.1:{port}",
                                         local_rank=0, backend="gloo")
        ensure_model_parallel_initialized(1, 1)
        from vllm_ling.layers.kda_cpu import register_cpu_kda

        assert register_cpu_kda()
        yield config
        if owns_process_group:  # leave no process group behind for later tests
            destroy_model_parallel()
            destroy_distributed_environment()


def test_register_is_idempotent_and_replaces_in_tree_class(vllm_config):
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_ling.layers.kda_cpu import cpu_kda_class, register_cpu_kda

    first = register_cpu_kda()
    assert first == register_cpu_kda()
    assert first and "CPU" in first[0]
    assert op_registry_oot["BailingMoeV3KimiDeltaAttention"] is cpu_kda_class()


def test_register_does_nothing_off_cpu(vllm_config, monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_ling.layers.kda_cpu import register_cpu_kda

    monkeypatch.delitem(op_registry_oot, "BailingMoeV3KimiDeltaAttention")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert register_cpu_kda() == []
    assert "BailingMoeV3KimiDeltaAttention" not in op_registry_oot


def test_register_leaves_a_foreign_replacement_and_says_so(vllm_config, monkeypatch, caplog):
    import logging

    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_ling.layers.kda_cpu import register_cpu_kda

    class Foreign:  # another plugin's replacement
        pass

    monkeypatch.setitem(op_registry_oot, "BailingMoeV3KimiDeltaAttention", Foreign)
    logging.getLogger("vllm.ling").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.ling.kda"):
            assert register_cpu_kda() == []
    finally:
        logging.getLogger("vllm.ling").removeHandler(caplog.handler)
    assert op_registry_oot["BailingMoeV3KimiDeltaAttention"] is Foreign
    assert any("NOT used" in r.getMessage() for r in caplog.records)


def build_layer(config, dtype=torch.float32, num_spec=0, seed=0, slots=SLOTS):
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3KimiDeltaAttention

    from vllm_ling.layers.kda_cpu import cpu_kda_class

    hf = types.SimpleNamespace(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_attention_heads=HEADS,
                               short_conv_kernel_size=CONV, kda_safe_gate=True,
                               kda_lower_bound=-5.0, no_kda_lora=True, rms_norm_eps=1e-6)
    prefix = f"model.layers.{next(_prefix_ids)}.attention"
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with set_current_vllm_config(config):
            layer = BailingMoeV3KimiDeltaAttention(
                hf, None, 0, prefix=prefix, model_config=types.SimpleNamespace(dtype=dtype),
                cache_config=config.cache_config, num_speculative_tokens=num_spec)
    finally:
        torch.set_default_dtype(old)
    assert type(layer) is cpu_kda_class()
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            scale = {"A_log": 0.5, "dt_bias": 1.0}.get(name.split(".")[-1], None)
            if "conv1d" in name:
                scale = 0.5
            elif "o_norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
                continue
            elif scale is None:
                scale = p.shape[-1] ** -0.5
            p.copy_(torch.randn(p.shape, generator=gen) * scale)
    for module in layer.modules():  # what vLLM's loader does after loading (CPU GEMM setup)
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    # the state cache exactly as vLLM binds it: one int8 page per slot, sliced per state
    shapes, dtypes = layer.get_state_shape(), layer.get_state_dtype()
    page = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size()
               for s, d in zip(shapes, dtypes))
    layer.bind_kv_cache(torch.zeros(slots, 1, 1, page, dtype=torch.int8))
    return layer


def metadata_builder(layer, config, num_spec=0, monkeypatch=None):
    import vllm.model_executor.layers.mamba.gdn.qwen_gdn_linear_attn as gdn_linear
    from vllm.v1.attention.backends.gdn_attn import GDNAttentionMetadataBuilder

    config.cache_config.mamba_block_size = 4096
    spec = layer.get_kv_cache_spec(config)
    # The builder asks the model config which GDN prefill kernel to use (Qwen-only
    # choice); this test has no model config, and the answer is unused on CPU.
    monkeypatch.setattr(gdn_linear, "_resolve_gdn_prefill_backend", lambda _: (None, "triton"))
    if num_spec:
        monkeypatch.setattr(config, "speculative_config",
                            types.SimpleNamespace(num_speculative_tokens=num_spec,
                                                  parallel_drafting=False), raising=False)
    return GDNAttentionMetadataBuilder(spec, [layer.prefix], config, torch.device("cpu"))


def build_metadata(builder, query_lens, computed, slots, drafts=None, accepted=None):
    """One scheduler step: per request its new tokens, tokens already computed, state
    slots (block table row) and, for speculative decoding, drafted tokens (-1 = not a
    spec decode) and tokens accepted last step."""
    from vllm.v1.attention.backend import CommonAttentionMetadata

    q = torch.tensor([0, *itertools.accumulate(query_lens)], dtype=torch.int32)
    seq_lens = torch.tensor([c + n for c, n in zip(computed, query_lens)], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=q, query_start_loc_cpu=q.clone(), seq_lens=seq_lens,
        num_reqs=len(query_lens), num_actual_tokens=int(q[-1]), max_query_len=max(query_lens),
        max_seq_len=int(seq_lens.max()), block_table_tensor=torch.tensor(slots, dtype=torch.int32),
        slot_mapping=torch.zeros(int(q[-1]), dtype=torch.int64),
        is_prefilling=torch.tensor([c == 0 for c in computed]),
        seq_lens_cpu_upper_bound=seq_lens.clone())
    kwargs = {}
    if drafts is not None:
        kwargs = dict(num_accepted_tokens=torch.tensor(accepted, dtype=torch.int32),
                      num_decode_draft_tokens_cpu=torch.tensor(drafts, dtype=torch.int32))
    return builder.build(0, common, **kwargs)


def run_layer(layer, config, metadata, hidden):
    from vllm.forward_context import set_forward_context

    out = torch.empty_like(hidden)
    with torch.no_grad(), set_forward_context({layer.prefix: metadata}, config):
        layer(hidden, torch.zeros(hidden.shape[0], dtype=torch.long), out)
    return out


def reference(layer, hidden):
    """Outputs of the layer for one whole sequence from a zero state, composed from the
    layer's modules and ops.kda's recurrent form. Also returns the final recurrent state
    and the q|k|v conv inputs."""
    from vllm_ling.ops import kda

    with torch.no_grad():
        n = hidden.shape[0]
        proj = layer.qkvb_proj(hidden)[0]
        width = HEADS * HEAD_DIM
        raw = proj[:, : 3 * width].split(width, dim=-1)
        beta = proj[:, 3 * width:].float().sigmoid()
        convs = []
        for x, m in zip(raw, (layer.q_conv1d, layer.k_conv1d, layer.v_conv1d)):
            pool = torch.zeros(2, width, CONV - 1, dtype=x.dtype)
            convs.append(kda.causal_conv1d_prefill(x, m.weight.reshape(width, CONV), None, pool,
                                                   torch.tensor([0, n]), torch.tensor([1]),
                                                   torch.tensor([False])))
        q, k, v = (c.reshape(n, HEADS, HEAD_DIM) for c in convs)
        g = kda.kda_gate(layer.f_proj(hidden)[0], layer.A_log, layer.dt_bias, lower_bound=-5.0)
        o, state = kda.kda_recurrent(q, k, v, g, beta, torch.zeros(1, HEADS, HEAD_DIM, HEAD_DIM),
                                     torch.tensor([0, n]), HEAD_DIM ** -0.5)
        gate = layer.g_proj(hidden)[0].reshape(n, HEADS, HEAD_DIM)
        normed = kda.gated_rms_norm(o, gate, layer.o_norm.weight, 1e-6)
        return layer.o_proj(normed.reshape(n, -1))[0], state[0], torch.cat(raw, dim=-1)


def hidden_states(n, seed, dtype=torch.float32):
    return torch.randn(n, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(dtype)


ATOL = 2e-4


def test_prefill_matches_reference_and_fills_vllm_cache(vllm_config, monkeypatch):
    layer = build_layer(vllm_config)
    builder = metadata_builder(layer, vllm_config, monkeypatch=monkeypatch)
    seqs = [hidden_states(13, 1), hidden_states(29, 2)]
    md = build_metadata(builder, [13, 29], [0, 0], [[3], [5]])
    assert md.num_prefills == 2
    out = run_layer(layer, vllm_config, md, torch.cat(seqs))
    conv_state, rec_state = layer.kv_cache  # vLLM's views: [slots, W-1, 3C], [slots, H, V, K]
    for seq, slot, rows in zip(seqs, (3, 5), (slice(0, 13), slice(13, 42))):
        want, state, conv_in = reference(layer, seq)
        torch.testing.assert_close(out[rows], want, atol=ATOL, rtol=0)
        torch.testing.assert_close(rec_state[slot], state, atol=ATOL, rtol=0)
        torch.testing.assert_close(conv_state[slot], conv_in[-(CONV - 1):])
    untouched = [s for s in range(SLOTS) if s not in (3, 5)]
    assert not bool(rec_state[untouched].any()) and not bool(conv_state[untouched].any())


@pytest.mark.parametrize("dtype,atol", [(torch.float32, ATOL), (torch.bfloat16, 3e-2)])
def test_prefill_chunks_then_decode_equal_one_sequence(vllm_config, monkeypatch, dtype, atol):
    """Request A: prefill in two chunks then 3 decode steps; request B joins later.
    Every output equals the whole-sequence reference."""
    layer = build_layer(vllm_config, dtype=dtype, seed=3)
    builder = metadata_builder(layer, vllm_config, monkeypatch=monkeypatch)
    a, b = hidden_states(20, 4, dtype), hidden_states(9, 5, dtype)
    outs_a, outs_b = [], []
    # step 1: A's first chunk (10 tokens)
    md = build_metadata(builder, [10], [0], [[2]])
    outs_a.append(run_layer(layer, vllm_config, md, a[:10]))
    # step 2: A's second chunk (7 tokens, continues from the cache) + B's whole prompt (6)
    md = build_metadata(builder, [7, 6], [10, 0], [[2], [6]])
    assert md.num_prefills == 2 and md.has_initial_state.tolist() == [True, False]
    out = run_layer(layer, vllm_config, md, torch.cat([a[10:17], b[:6]]))
    outs_a.append(out[:7])
    outs_b.append(out[7:])
    # steps 3-5: both decode one token per step
    for t in range(3):
        md = build_metadata(builder, [1, 1], [17 + t, 6 + t], [[2], [6]])
        assert md.num_decodes == 2 and md.num_prefills == 0
        out = run_layer(layer, vllm_config, md, torch.stack([a[17 + t], b[6 + t]]))
        outs_a.append(out[:1])
        outs_b.append(out[1:])
    want_a, state_a, _ = reference(layer, a)
    want_b, state_b, _ = reference(layer, b)
    torch.testing.assert_close(torch.cat(outs_a).float(), want_a.float(), atol=atol, rtol=0)
    torch.testing.assert_close(torch.cat(outs_b).float(), want_b.float(), atol=atol, rtol=0)
    rec_state = layer.kv_cache[1]
    torch.testing.assert_close(rec_state[2], state_a, atol=atol, rtol=0)
    torch.testing.assert_close(rec_state[6], state_b, atol=atol, rtol=0)


def test_spec_decode_with_accepted_tokens_and_mixed_prefill(vllm_config, monkeypatch):
    """MTP-style verify steps (3 tokens: 1 + 2 drafts) with vLLM's per-position state
    slots and sliding conv window; a second request prefills in the same step. Outputs
    of each step equal the reference over the tokens actually accepted before it."""
    num_spec = 2
    layer = build_layer(vllm_config, num_spec=num_spec, seed=7)
    builder = metadata_builder(layer, vllm_config, num_spec=num_spec, monkeypatch=monkeypatch)
    a, b = hidden_states(30, 8), hidden_states(5, 9)
    rows_a, rows_b = [1, 2, 3], [4, 5, 6]
    # step 1: A's prompt (8 tokens)
    md = build_metadata(builder, [8], [0], [rows_a], drafts=[-1], accepted=[1])
    run_layer(layer, vllm_config, md, a[:8])
    # step 2: A verifies 3 tokens (first decode after prefill: 1 accepted so far) while
    # B prefills: a mixed spec + non-spec batch
    md = build_metadata(builder, [3, 5], [8, 0], [rows_a, rows_b], drafts=[2, -1],
                        accepted=[1, 1])
    assert md.num_spec_decodes == 1 and md.num_prefills == 1
    out = run_layer(layer, vllm_config, md, torch.cat([a[8:11], b]))
    history = a[:11]  # the verify window is causal: every output of it is checkable
    want, _, _ = reference(layer, history)
    torch.testing.assert_close(out[:3], want[8:11], atol=ATOL, rtol=0)
    want_b, _, _ = reference(layer, b)
    torch.testing.assert_close(out[3:], want_b, atol=ATOL, rtol=0)
    # step 3 (spec only): 2 of the 3 tokens were accepted (a[8], a[9]); a[10] is rejected,
    # so the next window is 3 new tokens a[20:23] after a[:10]
    md = build_metadata(builder, [3], [10], [rows_a], drafts=[2], accepted=[2])
    assert md.num_spec_decodes == 1 and md.num_prefills == 0 and md.num_decodes == 0
    out = run_layer(layer, vllm_config, md, a[20:23])
    history = torch.cat([a[:10], a[20:23]])
    want, _, _ = reference(layer, history)
    torch.testing.assert_close(out, want[10:13], atol=ATOL, rtol=0)
    # step 4: all 3 accepted
    md = build_metadata(builder, [3], [13], [rows_a], drafts=[2], accepted=[3])
    out = run_layer(layer, vllm_config, md, a[23:26])
    want, state, _ = reference(layer, torch.cat([history, a[23:26]]))
    torch.testing.assert_close(out, want[13:16], atol=ATOL, rtol=0)
    # the state after the last token sits in the window's last slot
    torch.testing.assert_close(layer.kv_cache[1][rows_a[-1]], state, atol=ATOL, rtol=0)


@pytest.mark.parametrize("accepted_per_window", [[1, 9, 4, 9, 2], [9, 9, 9], [1, 1, 5, 8]])
def test_dspark_verify_windows_roll_back_to_any_accepted_prefix(vllm_config, monkeypatch, accepted_per_window):
    """DSpark verify windows: 8 drafts + the bonus position = 9 tokens per step, vLLM's 9 state slots
    per request and a conv window of W - 1 + 8 columns. After each window k of 9 tokens are accepted
    and the rest rolled back; the next window's outputs, and the state after the last accepted token,
    equal the reference run over exactly the accepted tokens (the rejected ones never happened)."""
    num_spec = 8
    rows = list(range(1, num_spec + 2))  # one state slot per verify position (slot 0 is vLLM's null block)
    layer = build_layer(vllm_config, num_spec=num_spec, seed=13, slots=len(rows) + 2)
    builder = metadata_builder(layer, vllm_config, num_spec=num_spec, monkeypatch=monkeypatch)
    stream = hidden_states(12 + 9 * (len(accepted_per_window) + 1), 14)
    history = stream[:12]
    run_layer(layer, vllm_config, build_metadata(builder, [12], [0], [rows], drafts=[-1], accepted=[1]), history)
    cursor, accepted = 12, 1
    for k in accepted_per_window + [9]:
        window = stream[cursor:cursor + 9]
        cursor += 9
        md = build_metadata(builder, [9], [history.shape[0]], [rows], drafts=[num_spec], accepted=[accepted])
        assert md.num_spec_decodes == 1 and md.num_prefills == 0 and md.num_decodes == 0
        out = run_layer(layer, vllm_config, md, window)
        want, _, _ = reference(layer, torch.cat([history, window]))
        torch.testing.assert_close(out, want[history.shape[0]:], atol=ATOL, rtol=0)
        history, accepted = torch.cat([history, window[:k]]), k
    # the state after the last accepted token sits in the slot of its window position
    _, state, _ = reference(layer, history)
    torch.testing.assert_close(layer.kv_cache[1][rows[accepted - 1]], state, atol=ATOL, rtol=0)


def test_profile_run_without_metadata_is_a_no_op(vllm_config):
    from vllm.forward_context import set_forward_context

    layer = build_layer(vllm_config, seed=11)
    hidden = hidden_states(4, 12)
    out = torch.empty_like(hidden)
    with torch.no_grad(), set_forward_context(None, vllm_config):
        layer(hidden, torch.zeros(4, dtype=torch.long), out)
    assert bool(torch.isfinite(out).all())
    assert not bool(layer.kv_cache[1].any())


# ---- the merged in-projection (vllm_ling.layers.kda_merged_in_proj) against vLLM's three linears

def fp8_quant_config():
    """Ling's block-FP8 config as the model sets it up: b_proj left in BF16 (suffix match)."""
    from vllm_ling.layers.quant_config import LingFp8Config
    from vllm_ling.models.ling3 import LingForCausalLM

    config = LingFp8Config(is_checkpoint_fp8_serialized=True, activation_scheme="dynamic",
                           ignored_layers=["b_proj"], weight_block_size=[128, 128])
    config.ignored_layers_match_mode = "suffix"
    config.packed_modules_mapping = dict(LingForCausalLM.packed_modules_mapping)
    return config


def _seeded(name: str, seed: int) -> torch.Generator:
    import zlib

    return torch.Generator().manual_seed(seed * 1000003 + zlib.crc32(name.encode()))


def _selection(layer):
    from vllm_ling.selection import Feature, recorded

    return recorded(layer, Feature.KDA_MERGED_IN_PROJ)


def _merged(layer) -> bool:
    """Whether the layer recorded the merge; it holds the merged linear its forward takes exactly then."""
    from vllm_ling.models.kda_merged_in_proj import KdaInProj

    merged = _selection(layer).choice is KdaInProj.MERGED
    assert merged is hasattr(layer, "qkvfg_proj"), _selection(layer)
    return merged


def build_fp8_layer(config, merged: bool, monkeypatch, seed=0, num_spec=0, cls=None, bind_cache=True):
    """A KDA layer with block-FP8 projections (merged or vLLM's three), every parameter drawn
    from a generator keyed by its name, so two layers built with the same seed hold the same
    numbers; q, k, v, f, g go through the layers' own weight loaders, shard by shard."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3KimiDeltaAttention

    from vllm_ling.models.kda_merged_in_proj import MEMBERS
    from vllm_ling.ops.fp8 import block_fp8_quantize

    monkeypatch.setenv("VLLM_LING_KDA_MERGED_IN_PROJ", "1" if merged else "0")
    hf = types.SimpleNamespace(hidden_size=HIDDEN, head_dim=HEAD_DIM, num_attention_heads=HEADS,
                               short_conv_kernel_size=CONV, kda_safe_gate=True,
                               kda_lower_bound=-5.0, no_kda_lora=True, rms_norm_eps=1e-6)
    with set_current_vllm_config(config):
        layer = (cls or BailingMoeV3KimiDeltaAttention)(
            hf, fp8_quant_config(), 0, prefix=f"model.layers.{next(_prefix_ids)}.attention",
            model_config=types.SimpleNamespace(dtype=torch.float32), cache_config=config.cache_config,
            num_speculative_tokens=num_spec)
    monkeypatch.delenv("VLLM_LING_KDA_MERGED_IN_PROJ")
    assert _merged(layer) is merged

    def quantized(name, rows, cols):
        return block_fp8_quantize(torch.randn(rows, cols, generator=_seeded(name, seed)) * cols ** -0.5)

    width = HEADS * HEAD_DIM
    members = {m: quantized(m, width, HIDDEN) for m in MEMBERS}
    if merged:
        targets = [(layer.qkvfg_proj, i, m) for i, m in enumerate(MEMBERS)]
    else:
        targets = [(layer.qkv_proj, i, m) for i, m in enumerate(MEMBERS[:3])]
        targets += [(layer.f_proj, None, "f_proj"), (layer.g_proj, None, "g_proj")]
    with torch.no_grad():
        for module, shard, member in targets:
            for param, tensor in zip((module.weight, module.weight_scale_inv), members[member]):
                args = () if shard is None else (shard,)
                param.weight_loader(param, tensor, *args)
        w, s = quantized("o_proj", HIDDEN, width)
        layer.o_proj.weight.copy_(w)
        layer.o_proj.weight_scale_inv.copy_(s)
        for name, p in layer.named_parameters():
            leaf = name.split(".")[-1]
            if name.startswith(("qkv", "f_proj", "g_proj", "o_proj")):
                continue
            gen = _seeded(name, seed)
            if "o_norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=gen))
            else:
                scale = {"A_log": 0.5, "dt_bias": 1.0}.get(leaf, 0.5 if "conv1d" in name else p.shape[-1] ** -0.5)
                p.copy_(torch.randn(p.shape, generator=gen) * scale)
    for module in layer.modules():
        method = getattr(module, "quant_method", None)
        if method is not None:
            method.process_weights_after_loading(module)
    if bind_cache:
        shapes, dtypes = layer.get_state_shape(), layer.get_state_dtype()
        page = sum(torch.Size(s).numel() * torch.empty(0, dtype=d).element_size() for s, d in zip(shapes, dtypes))
        layer.bind_kv_cache(torch.zeros(SLOTS, 1, 1, page, dtype=torch.int8))
    return layer


def test_merged_layer_builds_one_linear_of_five_shards(vllm_config, monkeypatch):
    layer = build_fp8_layer(vllm_config, True, monkeypatch)
    assert layer.qkvfg_proj.output_partition_sizes == [HEADS * HEAD_DIM] * 5
    # the same dense block-FP8 method as any other linear of the layer
    assert type(layer.qkvfg_proj.quant_method) is type(layer.o_proj.quant_method)
    assert type(layer.o_proj.quant_method).__name__ != "UnquantizedLinearMethod"
    assert layer.qkv_proj is None and layer.f_proj is None and layer.g_proj is None
    names = {n for n, _ in layer.named_parameters()}
    assert not any(n.startswith(("qkv_proj.", "f_proj.", "g_proj.")) for n in names)
    assert "b_proj.weight" in names and layer.b_proj.weight.dtype == torch.float32  # BF16 in the checkpoint


def test_merged_layer_computes_what_vllms_three_linears_compute(vllm_config, monkeypatch):
    """Same weights, same vLLM metadata: prefill of two requests, then two decode steps. fp32
    GEMMs over the same dequantized rows agree to rounding (1e-5); a shard in the wrong place
    (f and g swapped, say) changes every output at order 1."""
    layers = [build_fp8_layer(vllm_config, merged, monkeypatch, seed=21) for merged in (True, False)]
    outs = []
    for layer in layers:
        builder = metadata_builder(layer, vllm_config, monkeypatch=monkeypatch)
        a, b = hidden_states(11, 22), hidden_states(6, 23)
        steps = [run_layer(layer, vllm_config, build_metadata(builder, [11, 6], [0, 0], [[1], [4]]),
                           torch.cat([a, b]))]
        for t in range(2):
            x = torch.stack([hidden_states(1, 30 + t)[0], hidden_states(1, 40 + t)[0]])
            steps.append(run_layer(layer, vllm_config, build_metadata(builder, [1, 1], [11 + t, 6 + t],
                                                                      [[1], [4]]), x))
        outs.append(torch.cat(steps))
    merged, vllm_three = outs
    assert vllm_three.abs().max() > 1e-2  # the comparison is not between two zeros
    torch.testing.assert_close(merged, vllm_three, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(layers[0].kv_cache[1], layers[1].kv_cache[1], atol=1e-5, rtol=1e-5)


def test_opt_out_and_qkvb_keep_vllms_linears_with_one_warning(vllm_config, monkeypatch, caplog):
    import logging

    from vllm_ling.models.kda_merged_in_proj import KdaInProj, select_kda_merged_in_proj

    logging.getLogger("vllm.ling").addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.WARNING, logger="vllm.ling.kda"):
            plain = build_fp8_layer(vllm_config, False, monkeypatch)
    finally:
        logging.getLogger("vllm.ling").removeHandler(caplog.handler)
    assert _selection(plain).reason == "opted out (VLLM_LING_KDA_MERGED_IN_PROJ=0)"
    assert plain.qkv_proj.output_partition_sizes == [HEADS * HEAD_DIM] * 3 and plain.f_proj is not None
    assert not hasattr(plain, "qkvfg_proj")
    # the WARNING is logged once per process and reason (an earlier test may have logged it); one record may
    # reach caplog twice, through the handler above and, where "vllm.ling" propagates (this test alone), the root
    assert len({id(r) for r in caplog.records if "NOT merged" in r.getMessage()}) <= 1
    # b_proj in FP8: vLLM builds qkvb_proj, the merge refuses and says why
    qkvb = build_layer(vllm_config, seed=1)  # quant_config None: vLLM's qkvb_proj form
    assert not _merged(qkvb) and "qkvb_proj" in _selection(qkvb).reason
    assert _selection(qkvb).fallback_from is KdaInProj.MERGED  # asked for, refused for the checkpoint: reported
    # members of different precision
    differ = select_kda_merged_in_proj(True, True, ("f_proj",))
    assert differ.choice is KdaInProj.VLLM and "differ in precision (BF16: f_proj)" in differ.reason
    assert select_kda_merged_in_proj(True, True, ()).choice is KdaInProj.MERGED


# ---- the same merge with vLLM's own computation (the layer every non-CPU platform gets)

def test_vllm_kernel_layer_feeds_vllms_computation_the_same_parts(vllm_config, monkeypatch):
    """VllmKdaMergedInProj's forward against vLLM's own forward (the opted-out twin, same weights).
    vLLM's kernels are Triton-only, so both run with stand-ins for them: the KDA gate is
    ops.kda.kda_gate behind the Triton kernel's precondition (packed rows), the attention core a
    fixed mix of q, k, v, the gate and beta; o_norm (vLLM's CustomOp) runs its native path."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models import bailing_moe_v3

    from vllm_ling.layers.kda_merged_in_proj import vllm_merged_class
    from vllm_ling.ops import kda as kda_ops

    def gate_standin(g, A, head_k_dim, g_bias=None, lower_bound=None, **_):
        assert g.stride(0) == g.shape[-1], "fused_kda_gate's kernel reads packed rows"
        return kda_ops.kda_gate(g, A, g_bias, lower_bound=lower_bound)

    def core_standin(self, q_proj_states, k_proj_states, v_proj_states, g1, beta, core_attn_out):
        n = q_proj_states.shape[0]
        mix = (q_proj_states + 2 * k_proj_states + 3 * v_proj_states).float().view(
            1, n, self.local_num_heads, self.head_dim)
        core_attn_out.copy_((mix * g1.exp() * beta.unsqueeze(-1)).to(core_attn_out.dtype))

    cls = vllm_merged_class()
    monkeypatch.setattr(bailing_moe_v3, "fused_kda_gate", gate_standin)
    monkeypatch.setattr(cls, "_forward", core_standin)
    merged, plain = (build_fp8_layer(vllm_config, m, monkeypatch, seed=5, cls=cls, bind_cache=False)
                     for m in (True, False))
    assert type(merged) is cls and _merged(merged) and not _merged(plain)
    outs = []
    for layer in (merged, plain):
        x = hidden_states(5, 50)
        out = torch.empty_like(x)
        with torch.no_grad(), set_forward_context(None, vllm_config):
            layer(x, torch.zeros(5, dtype=torch.long), out)
        outs.append(out)
    assert outs[1].abs().max() > 1e-2
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)


def test_register_merged_kda_off_cpu(vllm_config, monkeypatch):
    from vllm.model_executor.custom_op import op_registry_oot

    from vllm_ling.layers.kda_cpu import register_cpu_kda
    from vllm_ling.layers.kda_merged_in_proj import register_merged_kda, vllm_merged_class

    assert register_merged_kda() == []  # on CPU the CPU layer carries the merge
    monkeypatch.delitem(op_registry_oot, "BailingMoeV3KimiDeltaAttention")
    monkeypatch.setattr(current_platform, "is_cpu", lambda: False)
    assert register_cpu_kda() == []
    done = register_merged_kda()
    assert done == register_merged_kda() and "qkvfg_proj" in done[0]  # idempotent
    assert op_registry_oot["BailingMoeV3KimiDeltaAttention"] is vllm_merged_class()


def test_tensor_parallel_rank_holds_the_concatenation_of_its_local_shards(vllm_config, monkeypatch):
    """TP=2, rank 1: the merged linear's local rows are [q, k, v, f, g] each cut to its second
    half, and its block scales are cut the same way (each half is 512 rows = 4 scale rows)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor import parameter
    from vllm.model_executor.layers import linear

    from vllm_ling.ops.fp8 import block_fp8_quantize

    for module in (linear, parameter):
        monkeypatch.setattr(module, "get_tensor_model_parallel_world_size", lambda: 2)
        monkeypatch.setattr(module, "get_tensor_model_parallel_rank", lambda: 1)
    width = HEADS * HEAD_DIM
    with set_current_vllm_config(vllm_config):
        merged = linear.MergedColumnParallelLinear(HIDDEN, [width] * 5, bias=False, quant_config=fp8_quant_config(),
                                                   prefix="model.layers.0.self_attn.qkvfg_proj")
    assert merged.output_partition_sizes == [width // 2] * 5
    gen = torch.Generator().manual_seed(9)
    members = [block_fp8_quantize(torch.randn(width, HIDDEN, generator=gen) * 0.05) for _ in range(5)]
    for shard, (w, s) in enumerate(members):
        merged.weight.weight_loader(merged.weight, w, shard)
        merged.weight_scale_inv.weight_loader(merged.weight_scale_inv, s, shard)
    half, blocks = width // 2, width // 2 // 128
    want_w = torch.cat([w[half:].view(torch.uint8) for w, _ in members])
    want_s = torch.cat([s[blocks:] for _, s in members])
    assert torch.equal(merged.weight.data.view(torch.uint8), want_w)
    assert torch.equal(merged.weight_scale_inv.data.float(), want_s.float())


# ---- the fused convolutions (vllm_ling.layers.kda_fused_conv) on the vLLM-kernel layer

def _gate_standin(g, A, head_k_dim, g_bias=None, lower_bound=None, **_):
    from vllm_ling.ops import kda as kda_ops

    return kda_ops.kda_gate(g.contiguous(), A, g_bias, lower_bound=lower_bound)


def _vllm_kernel_standins(monkeypatch) -> list[int]:
    """vLLM's Triton KDA decode kernels replaced by vllm_ling.ops.kda behind vLLM's signatures (the
    conv update writes its output into ``out``, else into its input, as vLLM's does). Returns the
    channel count of every conv launch."""
    from vllm.model_executor.models import bailing_moe_v3
    from vllm.third_party.flash_linear_attention.ops import kda as fla_kda

    from vllm_ling.ops import kda as kda_ops

    launches = []

    def conv(x, conv_state, weight, bias=None, activation=None, conv_state_indices=None, num_accepted_tokens=None,
             query_start_loc=None, max_query_len=-1, validate_data=False, out=None, **_):
        launches.append(x.shape[1])
        out = x if out is None else out
        out.copy_(kda_ops.causal_conv1d_update(x, weight, bias, conv_state, conv_state_indices,
                                               cu_seqlens=query_start_loc, num_accepted_tokens=num_accepted_tokens,
                                               activation=activation))
        return out

    def recurrent(q, k, v, g, beta, initial_state, cu_seqlens, ssm_state_indices, num_accepted_tokens=None,
                  scale=None, **_):
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        return kda_ops.kda_decode_pooled(q[0], k[0], v[0], g[0], beta[0], initial_state, cu_seqlens,
                                         ssm_state_indices, scale, num_accepted_tokens=num_accepted_tokens
                                         ).unsqueeze(0), None

    def conv_fn(x, weight, bias, conv_states, query_start_loc, cache_indices=None, has_initial_state=None,
                activation=None, metadata=None, **_):  # prefill: x [channels, tokens], channel-last
        launches.append(x.shape[0])
        return kda_ops.causal_conv1d_prefill(x.t(), weight, bias, conv_states, query_start_loc, cache_indices,
                                             has_initial_state, activation=activation).t()

    def chunked(q, k, v, g, beta, initial_state, output_final_state, cu_seqlens, **_):
        out, final = kda_ops.kda_chunked(q[0], k[0], v[0], g[0], beta[0], initial_state, cu_seqlens,
                                         q.shape[-1] ** -0.5)
        return out.unsqueeze(0), final.to(initial_state.dtype)

    def chunked_fused_gate(q, k, v, raw_g, beta, A_log, g_bias, initial_state, output_final_state, lower_bound,
                           cu_seqlens, **_):  # the gate inside the chunk cumsum: vLLM's Kimi path (fla module)
        g = kda_ops.kda_gate(raw_g[0].flatten(-2), A_log, g_bias, lower_bound=lower_bound)
        return chunked(q, k, v, g.unsqueeze(0), beta, initial_state, output_final_state, cu_seqlens)

    for name, fn in (("causal_conv1d_update", conv), ("fused_recurrent_kda", recurrent),
                     ("fused_recurrent_kda_fwd", recurrent), ("fused_kda_gate", _gate_standin),
                     ("causal_conv1d_fn", conv_fn), ("chunk_kda", chunked)):
        monkeypatch.setattr(bailing_moe_v3, name, fn)
    monkeypatch.setattr(fla_kda, "chunk_kda_with_fused_gate", chunked_fused_gate)
    # the output norm's CUDA kernel (what the op runs where the launch does not apply the norm): vLLM's own
    # decomposition of it, which its compiled forward runs
    monkeypatch.setattr(fla_kda.FusedRMSNormGated, "forward_cuda", fla_kda.FusedRMSNormGated.forward_native)
    return launches


def _fused_and_vllms(vllm_config, monkeypatch, num_spec, twin=True, decode=False, norm=True):
    """Two vLLM-kernel layers with the same weights, as built on CUDA: the fused convolutions and,
    opted out, vLLM's three launches (``twin``); their state caches hold the same random states. With
    ``decode`` the first serves the one-launch KDA decode (vllm_ling.layers.kda_decode), with the output norm
    inside it (vllm_ling.layers.kda_output_norm) where ``norm``, and the second the fused convolutions with
    vLLM's kernels and norm; without, neither serves the one launch."""
    from vllm_ling.layers import kda_merged_in_proj as M
    from vllm_ling.layers.kda_merged_in_proj import vllm_merged_class
    from vllm_ling.models.kda_decode import KdaDecode
    from vllm_ling.models.kda_fused_conv import KdaConv
    from vllm_ling.models.kda_output_norm import KdaOutputNorm
    from vllm_ling.selection import Feature, Platform, recorded

    monkeypatch.setattr(M, "serving_platform", lambda: Platform.CUDA)
    layers = []
    for first in (True, False)[:2 if twin else 1]:
        fused = first or decode
        monkeypatch.setenv("VLLM_LING_KDA_FUSED_CONV", "1" if fused else "0")
        monkeypatch.setenv("VLLM_LING_KDA_DECODE", "1" if decode and first else "0")
        monkeypatch.setenv("VLLM_LING_KDA_OUTPUT_NORM", "1" if norm else "0")
        layer = build_fp8_layer(vllm_config, True, monkeypatch, seed=5, num_spec=num_spec, cls=vllm_merged_class())
        assert recorded(layer, Feature.KDA_FUSED_CONV).choice is (KdaConv.FUSED if fused else KdaConv.SEPARATE)
        assert recorded(layer, Feature.KDA_DECODE).choice is (KdaDecode.LING if decode and first else KdaDecode.VLLM)
        assert recorded(layer, Feature.KDA_OUTPUT_NORM).choice is (
            KdaOutputNorm.LING if decode and first and norm else KdaOutputNorm.VLLM)
        with torch.no_grad():  # a norm weight of its own (vLLM builds ones): a launch ignoring it fails
            layer.o_norm.weight.copy_(1 + 0.5 * torch.randn(layer.o_norm.weight.shape,
                                                            generator=torch.Generator().manual_seed(3)))
        gen = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for state in layer.kv_cache:
                state.copy_(torch.randn(state.shape, generator=gen) * 0.5)
        layers.append(layer)
    monkeypatch.delenv("VLLM_LING_KDA_FUSED_CONV")
    monkeypatch.delenv("VLLM_LING_KDA_DECODE")
    monkeypatch.delenv("VLLM_LING_KDA_OUTPUT_NORM")
    return layers


def _steps_agree(vllm_config, layers, steps, launches):
    """Each step's outputs and both state caches equal; the fused layer made one conv launch of
    3 x the channels per step, vLLM's three."""
    width = HEADS * HEAD_DIM
    for i, (md, hidden) in enumerate(steps):
        launches.clear()
        fused_out = run_layer(layers[0], vllm_config, md, hidden)
        assert launches == [3 * width], launches
        launches.clear()
        vllms_out = run_layer(layers[1], vllm_config, md, hidden)
        assert launches == [width] * 3, launches
        assert fused_out.abs().max() > 1e-3
        torch.testing.assert_close(fused_out, vllms_out, atol=1e-5, rtol=1e-5, msg=f"step {i}")
        for a, b in zip(layers[0].kv_cache, layers[1].kv_cache):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6, msg=f"state after step {i}")


def test_fused_convolutions_decode_as_vllms_three_launches(vllm_config, monkeypatch):
    launches = _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0)
    builder = metadata_builder(layers[0], vllm_config, monkeypatch=monkeypatch)
    steps = [(build_metadata(builder, [1, 1, 1], [5 + t, 9 + t, 2 + t], [[3], [5], [6]]), hidden_states(3, 20 + t))
             for t in range(3)]
    assert steps[0][0].num_decodes == 3 and steps[0][0].spec_sequence_masks is None
    # a CUDA-graph-padded step: 4 rows of hidden states, 3 of them tokens (the padding row's core output is 0)
    steps.append((build_metadata(builder, [1, 1, 1], [8, 12, 5], [[3], [5], [6]]), hidden_states(4, 29)))
    _steps_agree(vllm_config, layers, steps, launches)


def test_fused_convolutions_verify_windows_as_vllms_three_launches(vllm_config, monkeypatch):
    """MTP verify windows of 3 tokens (2 drafts), per-position state slots, accepted 1, 2, 3."""
    launches = _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=2)
    builder = metadata_builder(layers[0], vllm_config, num_spec=2, monkeypatch=monkeypatch)
    rows_a, rows_b = [1, 2, 3], [4, 5, 6]
    steps = [(build_metadata(builder, [3, 3], [10 + 3 * t, 12 + 3 * t], [rows_a, rows_b], drafts=[2, 2],
                             accepted=[1 + t, 3 - t]), hidden_states(6, 30 + t)) for t in range(3)]
    assert steps[0][0].num_spec_decodes == 2 and steps[0][0].num_decodes == 0 and steps[0][0].num_prefills == 0
    _steps_agree(vllm_config, layers, steps, launches)


def _op_steps_agree(vllm_config, layers, steps):
    """The layers' KDA op (vllm_ling::kda_attention's function) on each step's BF16 rows, then the output norm
    where the op leaves it to the layer's forward (vLLM's, as compiled): the normed outputs (to BF16 rounding)
    and both state caches (conv states exactly) equal; CUDA-graph padding rows zero."""
    from vllm.forward_context import set_forward_context

    from vllm_ling.layers import kda_fused_conv as F, kda_output_norm

    width = HEADS * HEAD_DIM
    for i, (md, rows) in enumerate(steps):
        gen = torch.Generator().manual_seed(100 + i)
        row = (torch.randn(rows, 5 * width, generator=gen) * 2).bfloat16()
        beta_logits = torch.randn(rows, HEADS, generator=gen).bfloat16()
        outs = []
        for layer in layers:
            out = torch.full((1, rows, HEADS, HEAD_DIM), float("nan"), dtype=torch.bfloat16)
            gate = row[:, 4 * width:]
            with torch.no_grad(), set_forward_context({layer.prefix: md}, vllm_config):
                F.kda_attention(layer, row[:, :3 * width], row[:, 3 * width:4 * width], beta_logits, gate, out)
                if not kda_output_norm.active(layer):
                    out = layer.o_norm.forward_native(out, gate.unflatten(-1, (HEADS, HEAD_DIM)).unsqueeze(0))
            outs.append(out[0].float())
        n = md.num_actual_tokens
        assert torch.equal(outs[0][n:], torch.zeros_like(outs[0][n:])), f"padding rows, step {i}"
        err = (outs[0][:n] - outs[1][:n]).norm(dim=-1) / outs[1][:n].norm(dim=-1)
        assert float(err.max()) < 2 ** -7, f"step {i}: {float(err.max())}"
        (conv_a, rec_a), (conv_b, rec_b) = layers[0].kv_cache, layers[1].kv_cache
        assert torch.equal(conv_a, conv_b), f"conv states after step {i}"
        torch.testing.assert_close(rec_a, rec_b, atol=1e-5, rtol=1e-5, msg=f"recurrent states after step {i}")


def test_the_one_launch_decode_steps_as_the_fused_conv_and_vllms_kernels(vllm_config, monkeypatch,
                                                                        interpreted_kda_decode):
    """The layer's one-launch KDA decode (the Triton kernel, interpreted) against the fused convolutions
    with vLLM's kernels (plain-PyTorch stand-ins) on the same metadata: plain decodes (one step
    CUDA-graph padded), then a speculating layer's verify windows resuming after 1, 2 and 3 accepted."""
    _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, decode=True)
    builder = metadata_builder(layers[0], vllm_config, monkeypatch=monkeypatch)
    steps = [(build_metadata(builder, [1, 1, 1], [5 + t, 9 + t, 2 + t], [[3], [5], [6]]), 3) for t in range(2)]
    steps.append((build_metadata(builder, [1, 1, 1], [8, 12, 5], [[3], [5], [6]]), 4))  # a padding row
    _op_steps_agree(vllm_config, layers, steps)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=2, decode=True)
    builder = metadata_builder(layers[0], vllm_config, num_spec=2, monkeypatch=monkeypatch)
    steps = [(build_metadata(builder, [3, 3], [10 + 3 * t, 12 + 3 * t], [[1, 2, 3], [4, 5, 6]], drafts=[2, 2],
                             accepted=[1 + t, 3 - t]), 6) for t in range(3)]
    assert steps[0][0].num_spec_decodes == 2 and steps[0][0].num_decodes == 0
    _op_steps_agree(vllm_config, layers, steps)


def test_a_batch_with_a_prefill_keeps_vllms_kernels_under_the_one_launch_decode(vllm_config, monkeypatch):
    """Prefill steps (with a decode beside) go to the fused conv and vLLM's chunked kernel, the gate and
    beta computed in the op from the raw rows: equal to the layer without the one launch."""
    from vllm_ling.layers import kda_decode

    _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, decode=True)
    monkeypatch.setattr(kda_decode, "step", lambda *a, **k: pytest.fail("the one launch ran on a prefill step"))
    builder = metadata_builder(layers[0], vllm_config, monkeypatch=monkeypatch)
    _op_steps_agree(vllm_config, layers, [(build_metadata(builder, [1, 6], [7, 0], [[3], [5]]), 8)])


def test_fused_forward_through_an_mtp_request_as_vllms(vllm_config, monkeypatch):
    """A speculating model's request as the GPU's cuts test served it (lease 2026-12-06e): its prompt
    through the fused prefill (state slots of a model with 2 drafts per window), a verify window alone
    (1 accepted: the prefill's state), a verify window beside a new prompt (vLLM's forward), then
    verify windows of both with 3 and 2 accepted: each step's outputs and both state caches equal
    vLLM's forward."""
    launches = _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=2)
    builder = metadata_builder(layers[0], vllm_config, num_spec=2, monkeypatch=monkeypatch)
    rows_a, rows_b = [1, 2, 3], [4, 5, 6]
    prefill = build_metadata(builder, [5], [0], [rows_a], drafts=[-1], accepted=[1])
    assert prefill.spec_sequence_masks is None and prefill.num_prefills == 1
    verify = build_metadata(builder, [3], [5], [rows_a], drafts=[2], accepted=[1])
    assert verify.num_spec_decodes == 1 and verify.num_prefills == 0
    _steps_agree(vllm_config, layers, [(prefill, hidden_states(5, 70)), (verify, hidden_states(3, 71))], launches)
    mixed = build_metadata(builder, [3, 7], [8, 0], [rows_a, rows_b], drafts=[2, -1], accepted=[3, 1])
    assert mixed.num_spec_decodes == 1 and mixed.num_prefills == 1
    outs = [run_layer(layer, vllm_config, mixed, hidden_states(10, 72)) for layer in layers]
    torch.testing.assert_close(outs[0], outs[1], atol=1e-5, rtol=1e-5)
    both = build_metadata(builder, [3, 3], [11, 7], [rows_a, rows_b], drafts=[2, 2], accepted=[3, 1])
    again = build_metadata(builder, [3, 3], [14, 9], [rows_a, rows_b], drafts=[2, 2], accepted=[2, 3])
    _steps_agree(vllm_config, layers, [(both, hidden_states(6, 73)), (again, hidden_states(6, 74))], launches)


def test_the_output_norm_inside_the_launch_serves_an_mtp_request_as_vllms_norm(vllm_config, monkeypatch,
                                                                               interpreted_kda_decode):
    """The op of the layer with the one-launch decode and its output norm inside it
    (vllm_ling.layers.kda_output_norm) hands back normed rows for every batch, against vLLM's kernels with
    vLLM's norm after them: a prompt (vLLM's chunked kernel, then its norm kernel in the op), a verify window
    alone (the launch's norm), a verify window beside a new prompt (vLLM's forward, then the norm kernel),
    verify windows of both. The norm kernel runs in the op exactly for the batches the launch does not take."""
    from vllm.third_party.flash_linear_attention.ops import kda as fla_kda

    from vllm_ling.layers import kda_output_norm

    _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=2, decode=True)
    assert [kda_output_norm.active(layer) for layer in layers] == [True, False]
    in_op = []
    native = fla_kda.FusedRMSNormGated.forward_native
    monkeypatch.setattr(fla_kda.FusedRMSNormGated, "forward_cuda",
                        lambda self, *a, **k: (in_op.append(1), native(self, *a, **k))[1])
    builder = metadata_builder(layers[0], vllm_config, num_spec=2, monkeypatch=monkeypatch)
    rows_a, rows_b = [1, 2, 3], [4, 5, 6]
    steps = {"prompt": (build_metadata(builder, [5], [0], [rows_a], drafts=[-1], accepted=[1]), 5),
             "verify alone": (build_metadata(builder, [3], [5], [rows_a], drafts=[2], accepted=[1]), 3),
             "verify beside a prompt": (build_metadata(builder, [3, 7], [8, 0], [rows_a, rows_b], drafts=[2, -1],
                                                       accepted=[3, 1]), 10),
             "verify both": (build_metadata(builder, [3, 3], [11, 7], [rows_a, rows_b], drafts=[2, 2],
                                            accepted=[3, 1]), 6)}
    for name, step in steps.items():
        in_op.clear()
        _op_steps_agree(vllm_config, layers, [step])
        assert len(in_op) == (0 if name.startswith("verify") and "prompt" not in name else 1), name


def test_the_one_launch_decodes_known_answer_runs_the_layers_own_verify_window(vllm_config, monkeypatch,
                                                                              interpreted_kda_decode):
    """The startup check of the one-launch KDA decode verifies windows as long as the layer's (vLLM's
    ``num_speculative_tokens``): a DSpark server's 9-token windows take the kernel's streamed path, which a
    check of MTP's 4-token windows would never run."""
    from vllm_ling.layers import kda_decode, kda_fused_conv
    from vllm_ling.layers import known_answer as layer_checks

    built = _fused_and_vllms(vllm_config, monkeypatch, num_spec=8, twin=False, decode=True)[0]
    assert built.num_speculative_tokens == 8
    # the layer as the check reads it, at one head of 32 (the interpreter runs this layer's heads in 80 s)
    layer = types.SimpleNamespace(local_num_heads=1, head_dim=32, lower_bound=built.lower_bound,
                                  safe_gate=built.safe_gate, num_speculative_tokens=built.num_speculative_tokens,
                                  **{kda_fused_conv.WEIGHT_ATTR: getattr(built, kda_fused_conv.WEIGHT_ATTR)})
    windows, launch = [], kda_decode.launch

    def served(call, out):  # what the check hands the op's launch: its verify windows' length
        windows.append(call.slots.shape[1] if call.spec else 1)
        return launch(call, out)

    monkeypatch.setattr(kda_decode, "launch", served)
    result = layer_checks.check_kda_decode(layer)
    assert result.passed, result.failing_inputs
    assert 9 in windows and set(windows) <= {1, 9}, windows


class _OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """The aten ops a forward dispatches, and how many of them index with a boolean mask (on CUDA a
    ``nonzero`` inside the op: a host sync)."""

    def __init__(self):
        super().__init__()
        self.seen = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.seen[name] += 1
        if name in ("index", "index_put", "index_put_", "_index_put_impl_", "nonzero", "masked_select"):
            indices = args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else []
            if name in ("nonzero", "masked_select") or any(
                    torch.is_tensor(i) and i.dtype == torch.bool for i in indices):
                self.seen["mask index"] += 1
        return func(*args, **(kwargs or {}))


def test_fused_prefill_equals_vllms_forward_without_its_mask_index(vllm_config, monkeypatch):
    """A decode, a new sequence and a continued one in one step (vLLM's chunked path takes them all),
    then a decode step that reads the states the prefill left: outputs and both caches equal vLLM's
    forward (its kernels stood in by the same plain-PyTorch functions), one conv launch instead of
    three, and no boolean-mask index (vLLM's zeroing of new sequences' states through one, a host sync
    per layer on CUDA, is what the counter sees in vLLM's forward)."""
    launches = _vllm_kernel_standins(monkeypatch)
    layers = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0)
    builder = metadata_builder(layers[0], vllm_config, monkeypatch=monkeypatch)
    prefill = build_metadata(builder, [1, 6, 9], [7, 0, 4], [[3], [5], [6]])
    assert (prefill.num_decodes, prefill.num_prefills) == (1, 2)
    assert prefill.has_initial_state.tolist() == [True, False, True]
    steps = [(prefill, hidden_states(16, 60)),
             (build_metadata(builder, [1, 1, 1], [8, 6, 13], [[3], [5], [6]]), hidden_states(3, 61))]
    _steps_agree(vllm_config, layers, steps, launches)
    # the new sequence's slot held a random state: the outputs above prove it was not read; here the sync.
    # Counted inside the opaque ops (a dispatch mode outside sees each as one call): the fused forward and
    # vLLM's run under one counter each time
    from vllm_ling.layers import kda_fused_conv as F
    from vllm_ling.layers.kda_merged_in_proj import vllm_merged_class

    counter = _OpCounter()

    def counted(fn):
        def run(*args, **kwargs):
            with counter:
                return fn(*args, **kwargs)
        return run

    monkeypatch.setattr(F, "kda_attention", counted(F.kda_attention))
    monkeypatch.setattr(vllm_merged_class(), "_forward", counted(vllm_merged_class()._forward))
    counts = []
    for layer in layers:
        counter.seen.clear()
        run_layer(layer, vllm_config, build_metadata(builder, [1, 6, 9], [9, 0, 14], [[3], [7], [6]]),
                  hidden_states(16, 62))
        assert sum(counter.seen.values()) > 20  # it saw the forward's ops
        counts.append(counter.seen["mask index"])
    assert counts[0] == 0 and counts[1] > 0, counts


@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_the_fused_op_writes_the_buffer_the_next_piece_reads(vllm_config, monkeypatch, step):
    """The splitting op's contract with vLLM's piecewise CUDA graphs: a piece replays the addresses its
    inputs had at capture, so what the layer's next piece reads (o_norm's input) must be a buffer the
    compiled code allocated before the op, written in place by it, never a tensor the eager op returns
    (lease 2026-12-06e's tiny MTP server: garbage, then a drafted token outside the vocabulary)."""
    from vllm_ling.layers import kda_fused_conv as F

    _vllm_kernel_standins(monkeypatch)
    [fused] = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, twin=False)
    builder = metadata_builder(fused, vllm_config, monkeypatch=monkeypatch)
    md = (build_metadata(builder, [1, 6], [7, 0], [[3], [5]]) if step == "prefill"
          else build_metadata(builder, [1, 1], [5, 9], [[3], [5]]))
    written, read = [], []
    op = F.kda_attention

    def spy_op(layer, qkv, f, beta_logits, g, core_attn_out):
        written.append((core_attn_out.data_ptr(), op(layer, qkv, f, beta_logits, g, core_attn_out)))

    norm = fused.o_norm.forward

    def spy_norm(x, *args, **kwargs):
        read.append(x.data_ptr())
        return norm(x, *args, **kwargs)

    monkeypatch.setattr(F, "kda_attention", spy_op)
    monkeypatch.setattr(fused.o_norm, "forward", spy_norm)
    out = run_layer(fused, vllm_config, md, hidden_states(md.num_actual_tokens + 1, 80))  # one padding row
    assert [ptr for ptr, _ in written] == read and [result for _, result in written] == [None]
    assert out[:-1].abs().max() > 1e-3


def test_a_batch_of_verify_windows_and_a_prefill_goes_to_vllms_forward_with_q_k_v(vllm_config, monkeypatch):
    from vllm_ling.layers.kda_merged_in_proj import vllm_merged_class

    _vllm_kernel_standins(monkeypatch)
    fused, _ = _fused_and_vllms(vllm_config, monkeypatch, num_spec=2)
    seen = []

    def vllms_forward(self, q_proj_states, k_proj_states, v_proj_states, g1, beta, core_attn_out):
        seen.append(tuple(t.shape[1] for t in (q_proj_states, k_proj_states, v_proj_states)))

    monkeypatch.setattr(vllm_merged_class(), "_forward", vllms_forward)
    builder = metadata_builder(fused, vllm_config, num_spec=2, monkeypatch=monkeypatch)
    md = build_metadata(builder, [3, 5], [8, 0], [[1, 2, 3], [4, 5, 6]], drafts=[2, -1], accepted=[1, 1])
    assert md.num_spec_decodes == 1 and md.num_prefills == 1
    run_layer(fused, vllm_config, md, hidden_states(8, 40))
    assert seen == [(HEADS * HEAD_DIM,) * 3]


def test_the_fused_forward_traces_whole_under_torch_compile(vllm_config, monkeypatch):
    """vLLM compiles the model with torch.compile(fullgraph=True): the fused forward, its opaque op
    (the fake implementation's shape and dtype) and the op's result traced in one graph, functionalized
    (aot_eager, as Inductor's front end), equal to the eager forward."""
    from vllm_ling.layers.kda_merged_in_proj import vllm_merged_class

    launches = _vllm_kernel_standins(monkeypatch)
    [fused] = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, twin=False)
    assert type(fused) is vllm_merged_class()
    builder = metadata_builder(fused, vllm_config, monkeypatch=monkeypatch)
    md = build_metadata(builder, [1, 1], [5, 9], [[3], [5]])
    hidden = hidden_states(2, 50)
    saved = [t.clone() for t in fused.kv_cache]
    eager = run_layer(fused, vllm_config, md, hidden)
    with torch.no_grad():
        for t, s in zip(fused.kv_cache, saved):
            t.copy_(s)
    launches.clear()
    torch._dynamo.reset()
    compiled = torch.compile(fused.forward, fullgraph=True, backend="aot_eager", dynamic=False)
    from vllm.forward_context import set_forward_context

    out = torch.empty_like(hidden)
    with torch.no_grad(), set_forward_context({fused.prefix: md}, vllm_config):
        compiled(hidden, torch.zeros(2, dtype=torch.long), out)
    assert launches == [3 * HEADS * HEAD_DIM]  # the fused op ran, once
    torch.testing.assert_close(out, eager, atol=1e-6, rtol=1e-6)


# ---- the KDA layer's output as a value (vllm_ling.models.kda_direct_output) against vLLM's decoder layer

class _DecoderLayer(torch.nn.Module):
    """What vLLM's ``BailingMoeV3DecoderLayer.forward`` reads of a KDA decoder layer: vLLM's RMSNorms,
    the KDA layer, and an MLP (a linear stands in for the MoE: the hand-off is before it)."""

    is_kda_layer = True

    def __init__(self, attention):
        from vllm.model_executor.layers.layernorm import RMSNorm

        super().__init__()
        gen = torch.Generator().manual_seed(21)
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(HIDDEN, eps=1e-6), RMSNorm(HIDDEN, eps=1e-6)
        self.self_attn, self.mlp = attention, torch.nn.Linear(HIDDEN, HIDDEN, bias=False)
        with torch.no_grad():
            for norm in (self.input_layernorm, self.post_attention_layernorm):
                norm.weight.copy_(1 + 0.1 * torch.randn(HIDDEN, generator=gen))
            self.mlp.weight.copy_(torch.randn(HIDDEN, HIDDEN, generator=gen) * HIDDEN ** -0.5)


def _both_steps(decoder, config, md, hidden, residual):
    """vLLM's decoder forward and vllm-ling's direct step from the same KDA states: (vLLM's, ours)."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3DecoderLayer

    from vllm_ling.models.kda_direct_output import decoder_step

    saved = [t.clone() for t in decoder.self_attn.kv_cache]
    results = []
    for step in (lambda: BailingMoeV3DecoderLayer.forward(decoder, hidden, torch.zeros(len(hidden), dtype=torch.long),
                                                          residual),
                 lambda: decoder_step(decoder, hidden, residual)):
        with torch.no_grad():
            for t, s in zip(decoder.self_attn.kv_cache, saved):
                t.copy_(s)
            with set_forward_context({decoder.self_attn.prefix: md}, config):
                results.append(step())
    return results


@pytest.mark.parametrize("layer_kind", ["cpu", "cuda_fused"])
@pytest.mark.parametrize("step", ["prefill", "decode"])
def test_the_direct_decoder_step_computes_vllms_decoder_layer(vllm_config, monkeypatch, layer_kind, step):
    """vLLM's own decoder-layer forward (the zero-filled buffer the KDA layer copies into) and the model's
    direct step (the KDA layer's returned output) give the same hidden states and residual, bit for bit,
    on the CPU layer and on the layer CUDA builds (its Triton kernels stood in), with and without the first
    layer's missing residual."""
    if layer_kind == "cpu":
        attention = build_layer(vllm_config, seed=31)
    else:
        _vllm_kernel_standins(monkeypatch)
        [attention] = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, twin=False)
    decoder = _DecoderLayer(attention)
    builder = metadata_builder(attention, vllm_config, monkeypatch=monkeypatch)
    md = (build_metadata(builder, [5, 3], [0, 0], [[3], [5]]) if step == "prefill"
          else build_metadata(builder, [1, 1], [5, 9], [[3], [5]]))
    hidden = hidden_states(md.num_actual_tokens, 90)
    for residual in (None, hidden_states(md.num_actual_tokens, 91)):
        (want_hidden, want_residual), (hidden_out, residual_out) = _both_steps(decoder, vllm_config, md, hidden,
                                                                               residual)
        assert want_hidden.abs().max() > 1e-3  # the attention computed something
        torch.testing.assert_close(hidden_out, want_hidden, atol=0, rtol=0)
        torch.testing.assert_close(residual_out, want_residual, atol=0, rtol=0)


def test_a_decoder_layer_takes_the_direct_step_only_where_recorded(vllm_config, monkeypatch):
    """The model's branch reads the flag the selection wrote: on by default on vllm-ling's KDA layer, off when
    opted out (with the buffer recorded), and vLLM's own class (no ``attention_output``) falls back, said."""
    from vllm_ling.models import kda_direct_output as D
    from vllm_ling.selection import Feature, recorded

    decoder = _DecoderLayer(build_layer(vllm_config, seed=32))
    D.install([decoder])
    assert D.hands_output_directly(decoder)
    assert recorded(decoder.self_attn, Feature.KDA_DIRECT_OUTPUT).choice is D.KdaOutput.DIRECT
    monkeypatch.setenv(D.OPTION, "0")
    D.install([decoder])
    assert not D.hands_output_directly(decoder)
    assert recorded(decoder.self_attn, Feature.KDA_DIRECT_OUTPUT).reason == f"opted out ({D.OPTION}=0)"
    monkeypatch.delenv(D.OPTION)
    vllms = D.select_kda_direct_output(True, returns_output=False)
    assert vllms.choice is D.KdaOutput.BUFFER and vllms.fallback_from is D.KdaOutput.DIRECT


def _functional_graph_ops(fn, *args) -> collections.Counter:
    """The ATen ops of ``fn``'s graph as Inductor receives it (torch.compile, AOT autograd's
    functionalized forward), by name."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd

    ops = collections.Counter()

    def keep(gm, _):
        ops.update(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return make_boxed_func(gm.forward)

    torch._dynamo.reset()
    torch.compile(fn, fullgraph=True, backend=aot_autograd(fw_compiler=keep), dynamic=False)(*args)
    return ops


def test_the_direct_step_compiles_without_the_buffers_fill_and_copy(vllm_config, monkeypatch):
    """What the cut is for: in the graph Inductor compiles, vLLM's decoder layer fills a buffer with zeros
    and copies the KDA layer's output into it (across vLLM's graph split: an input the next piece mutates);
    the direct step has neither, and every other op is the same."""
    from vllm.forward_context import set_forward_context
    from vllm.model_executor.models.bailing_moe_v3 import BailingMoeV3DecoderLayer

    from vllm_ling.models.kda_direct_output import decoder_step

    _vllm_kernel_standins(monkeypatch)
    [attention] = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, twin=False)
    decoder = _DecoderLayer(attention)
    builder = metadata_builder(attention, vllm_config, monkeypatch=monkeypatch)
    md = build_metadata(builder, [1, 1], [5, 9], [[3], [5]])
    hidden, residual = hidden_states(2, 92), hidden_states(2, 93)
    positions = torch.zeros(2, dtype=torch.long)
    with torch.no_grad(), set_forward_context({attention.prefix: md}, vllm_config):
        vllms = _functional_graph_ops(lambda h, r: BailingMoeV3DecoderLayer.forward(decoder, h, positions, r),
                                      hidden, residual)
        ours = _functional_graph_ops(lambda h, r: decoder_step(decoder, h, r), hidden, residual)
    assert vllms - ours == collections.Counter({"aten.zeros_like.default": 1, "aten.copy.default": 1})
    assert not ours - vllms


# ---- the output norm inside the one-launch decode (vllm_ling.models.kda_output_norm): the selection

def test_the_output_norm_is_selected_only_where_the_launch_serves_and_takes_the_layers_norm():
    from vllm_ling.models.kda_output_norm import OPTION, KdaOutputNorm, select_kda_output_norm
    from vllm_ling.selection import Platform

    served = select_kda_output_norm(True, Platform.CUDA, True, [])
    assert served.choice is KdaOutputNorm.LING and served.fallback_from is None
    opted_out = select_kda_output_norm(False, Platform.CUDA, True, [])
    assert opted_out.choice is KdaOutputNorm.VLLM and opted_out.reason == f"opted out ({OPTION}=0)"
    assert opted_out.fallback_from is None
    # another switch's consequence (the launch opted out) and the CPU platform: not asked for, no fallback
    for args in ((True, Platform.CUDA, False, []), (True, Platform.CPU, True, [])):
        s = select_kda_output_norm(*args)
        assert s.choice is KdaOutputNorm.VLLM and s.fallback_from is None, args
    fallback = select_kda_output_norm(True, Platform.CUDA, True, ["the norm has a bias"])
    assert fallback.choice is KdaOutputNorm.VLLM and fallback.fallback_from is KdaOutputNorm.LING
    assert fallback.reason == "the norm has a bias"


def test_the_layer_names_what_keeps_the_norm_out_of_the_launch(vllm_config, monkeypatch):
    """From the norm vLLM built: a swish gate, a weight of another size, or no norm at all."""
    from vllm_ling.layers.kda_output_norm import norm_problems

    layer = build_layer(vllm_config, seed=33)
    assert norm_problems(layer) == []
    monkeypatch.setattr(layer.o_norm, "activation", "swish")
    assert norm_problems(layer) == ["the output gate's activation is 'swish', not 'sigmoid'"]
    monkeypatch.setattr(layer.o_norm, "activation", "sigmoid")
    monkeypatch.setattr(layer.o_norm, "weight", torch.nn.Parameter(torch.ones(layer.head_dim + 1)))
    assert norm_problems(layer) == ["the norm has no weight of one value per head channel"]
    monkeypatch.delattr(layer, "o_norm")
    assert norm_problems(layer) == ["the layer has no o_norm"]


def test_the_reader_reads_the_flag_the_op_and_the_forward_read(vllm_config, monkeypatch):
    """Norm inside the launch where the flag is set and the launch serves the layer; a flag without the launch
    is a defect the row names; no flag: vLLM's norm."""
    from vllm_ling.layers import kda_decode, kda_output_norm
    from vllm_ling.models.kda_output_norm import KdaOutputNorm

    _vllm_kernel_standins(monkeypatch)
    ours, vllms = _fused_and_vllms(vllm_config, monkeypatch, num_spec=0, decode=True)
    assert kda_output_norm.served(ours).key[0] is KdaOutputNorm.LING
    assert kda_output_norm.served(vllms).key[0] is KdaOutputNorm.VLLM
    monkeypatch.setattr(ours, kda_decode.ACTIVE_ATTR, False)
    assert kda_output_norm.served(ours).key[0] is None
