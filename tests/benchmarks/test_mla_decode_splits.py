"""benchmarks/mla_decode_splits.py on the CPU: its fp32 reference is causal from the end of the context
(the verify window's first token does not see the tokens after it), and its table reads each row against
vLLM's 32 splits at the same context and window. The timed rows need FlashAttention 3 on a GPU: the
lease's ``mla-splits`` phase (scripts/h200_session.sh) runs the benchmark there."""

from __future__ import annotations

import torch

from benchmarks import mla_decode_splits as B


def _layer(context: int, tokens: int, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    cache = torch.randn(context, B.LATENT + B.ROPE, generator=gen)
    q_nope = torch.randn(tokens, B.HEADS, B.LATENT, generator=gen)
    q_pe = torch.randn(tokens, B.HEADS, B.ROPE, generator=gen)
    return q_nope, q_pe, cache


def _naive(q_nope, q_pe, cache, seen: int, scale: float, t: int, h: int) -> torch.Tensor:
    """One query token and head, written out: softmax over the first ``seen`` keys."""
    keys = cache[:seen].double()
    scores = (keys[:, :B.LATENT] @ q_nope[t, h].double() + keys[:, B.LATENT:] @ q_pe[t, h].double()) * scale
    return torch.softmax(scores, dim=0) @ keys[:, :B.LATENT]


def test_the_reference_is_attention_over_the_tokens_each_query_sees():
    context, tokens, scale = 40, 4, 0.07
    q_nope, q_pe, cache = _layer(context, tokens)
    got = B.reference(q_nope, q_pe, cache, context, scale)
    for t in range(tokens):
        for h in (0, B.HEADS - 1):
            want = _naive(q_nope, q_pe, cache, context - tokens + t + 1, scale, t, h)
            assert torch.allclose(got[t, h].double(), want, rtol=1e-4, atol=1e-5), (t, h)


def test_the_reference_reads_only_the_context_it_is_given():
    q_nope, q_pe, cache = _layer(64, 1)
    assert torch.equal(B.reference(q_nope, q_pe, cache, 32, 0.1), B.reference(q_nope, q_pe, cache[:32], 32, 0.1))


def test_the_table_reads_each_row_against_vllms_bound_at_its_context_and_window():
    results = [{"context": 32768, "tokens": 1, "splits": 32, "us": 40.0, "error": 1e-3},
               {"context": 32768, "tokens": 1, "splits": 128, "us": 16.0, "error": 2e-3},
               {"context": 32768, "tokens": 4, "splits": 128, "us": 20.0, "error": 2e-3}]
    text = B.table(results, 3000.0, "copy kernel", 100, "H100, 132 SMs")
    rows = [line for line in text.splitlines() if line.startswith("| 32768")]
    assert rows[1].split(" | ")[6] == "2.50x"  # 40 / 16 at the same context and one token
    assert rows[2].split(" | ")[6] == "-"  # no 32-split row for the 4-token window
    # 37,748,736 bytes in 16 us against 3,000 GB/s
    assert rows[1].split(" | ")[5] == f"{B.cache_bytes(32768) / 16e-6 / 3e12:.3f}"


def test_each_timed_graph_reads_more_than_the_l2():
    for context in (512, 4096, 32768, 131072):
        n = B.distinct_caches(context)
        assert n >= B.LAYERS and n * B.cache_bytes(context) >= B.ROTATE_BYTES
        assert n == B.LAYERS or (n - 1) * B.cache_bytes(context) < B.ROTATE_BYTES  # no more than needed
