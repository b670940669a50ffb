"""Weights for ``vllm-ling make-tiny --agreeing``: a target that is a deterministic
next-token machine and a NEXTN layer that provably predicts what the target will predict.

Construction (all other tensors stay random, in the real -fp4 format):

1. Every block writes nothing to the residual stream: the KDA ``o_proj``, the MLA
   ``dense``, the dense-MLP ``down_proj``, the shared-expert ``down_proj`` and every routed
   expert's ``down_proj`` are zero. So after any number of layers the residual stream at
   position t is exactly the embedding ``E[x_t]`` of the token there, and the final
   (unit-weight) RMSNorm gives ``h_t = rmsnorm(E[x_t])``: the target's logits depend on the
   current token only.
2. The head is a permuted copy of the embeddings: ``W[f(v)] = E[v]`` for a fixed random
   permutation ``f`` of the ordinary tokens (special tokens, EOS and the chat markers included,
   have zero rows).
   The logit of ``j`` is ``E[f^-1(j)] . rmsnorm(E[v])``: for ``j = f(v)`` it is
   ``|E[v]|^2 / rms`` (about ``sqrt(H)`` times larger than any cross term of independent
   Gaussian rows), so the target always emits ``f(x_t)``, with a margin far beyond FP8/BF16
   rounding (the FP8 head keeps the same argmax).
3. The NEXTN layer receives ``enorm(E[x_{t+1}])`` and ``hnorm(h_t)``; its ``eh_proj`` is
   ``[I | 0]`` (keep the embedding half), its attention ``dense`` and MLP down projections are
   zero and its norms have unit weight, so its output is ``rmsnorm(E[x_{t+1}])`` and the
   shared head predicts ``f(x_{t+1})`` -- exactly the target's prediction at position t+1.
   Drafting k tokens chains the same argument (each draft step's input token is the previous
   draft), so under greedy decoding all k drafts are accepted: accept length k+1.

The identity in ``eh_proj`` is exactly representable in FP8 e4m3 (1.0 = 256 * 2**-8 with a
power-of-two block scale) and zero blocks stay zero, so the -fp4 storage keeps the property.
"""

from __future__ import annotations

from typing import Any

import torch

from vllm_ling.models.chat_format import MARKERS
from vllm_ling.models.checkpoint_format import checkpoint_specs

SPECIAL_TOKENS = 3  # <pad>, <eos>, <bos> of the tiny tokenizer (ids 0, 1, 2)


def ordinary_tokens(vocab_size: int) -> torch.Tensor:
    """Ids the permutation moves: not <pad>/<eos>/<bos>, not the chat markers (the last ids),
    so the agreeing target never ends a turn or opens markup by itself."""
    return torch.arange(SPECIAL_TOKENS, vocab_size - len(MARKERS))


_ZERO_SUFFIXES = (".attention.o_proj.weight", ".attention.dense.weight", ".down_proj.weight")


def next_token_permutation(vocab_size: int, seed: int) -> torch.Tensor:
    """f as a tensor: f[v] for ordinary tokens, -1 for special ones."""
    gen = torch.Generator().manual_seed(seed + 7919)
    f = torch.full((vocab_size,), -1, dtype=torch.long)
    ordinary = ordinary_tokens(vocab_size)
    f[ordinary] = ordinary[torch.randperm(len(ordinary), generator=gen)]
    return f


def agreeing_overrides(config: dict[str, Any], seed: int = 0) -> dict[str, torch.Tensor]:
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    gen = torch.Generator().manual_seed(seed + 104729)
    embeddings = torch.randn(vocab, hidden, generator=gen) * 0.02
    f = next_token_permutation(vocab, seed)
    head = torch.zeros(vocab, hidden)
    ordinary = ordinary_tokens(vocab)
    head[f[ordinary]] = embeddings[ordinary]
    out = {"model.word_embeddings.weight": embeddings, "lm_head.weight": head}
    n = config["num_hidden_layers"]
    for spec in checkpoint_specs(config, include_mtp=True):
        if spec.name.endswith(_ZERO_SUFFIXES):
            out[spec.name] = torch.zeros(spec.shape)
        elif spec.name.endswith("norm.weight") and spec.layer is not None and spec.layer >= n:
            out[spec.name] = torch.ones(spec.shape)
    for i in range(n, n + config.get("num_nextn_predict_layers", 0)):
        out[f"model.layers.{i}.eh_proj.weight"] = torch.cat(
            [torch.eye(hidden), torch.zeros(hidden, hidden)], dim=1)
    out["model.norm.weight"] = torch.ones(hidden)
    return out


def expected_continuation(prompt_last_token: int, steps: int, config: dict[str, Any],
                          seed: int = 0) -> list[int]:
    """The tokens the agreeing target emits after a prompt ending in ``prompt_last_token``."""
    f = next_token_permutation(config["vocab_size"], seed)
    out, t = [], prompt_last_token
    for _ in range(steps):
        t = int(f[t])
        out.append(t)
    return out


# ---- the agreeing DSpark drafter (``make-tiny DIR --agreeing --dspark DRAFT_DIR``)

# Markov bias of the right token over the best wrong one, in logits: far above the backbone's
# cross terms at the mask positions (about 0.02 * sqrt(hidden) per row, ~1 at the tiny size)
# and BF16 rounding of the Markov weights.
DSPARK_MARKOV_SCALE = 32.0
DSPARK_MIN_MARGIN = 4.0


def target_next_tokens(embeddings: torch.Tensor, head: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """The agreeing target's greedy next token after each token ``p`` (its logits depend on the
    current token only): ``argmax_j head[j] . rmsnorm(E[p])``, computed from its own weights."""
    e = embeddings.float()
    normed = e * torch.rsqrt(e.pow(2).mean(-1, keepdim=True) + eps)
    return (normed @ head.float().t()).argmax(-1)


def agreeing_dspark_overrides(specs, embeddings: torch.Tensor, head: torch.Tensor, markov_rank: int,
                              seed: int = 0) -> dict[str, torch.Tensor]:
    """Drafter weights whose every draft is the target's greedy token, for a target whose next token
    depends on the current token alone (the agreeing and the scripted checkpoints).

    1. Every drafter layer writes nothing to its residual stream (``o_proj`` and ``down_proj``
       zero, unit norms): position 0 (the anchor token ``a``) ends as ``rmsnorm(E[a])``, so its base
       logits through the shared head are exactly the target's own logits for ``a``; the mask
       positions end as ``rmsnorm(E[mask])``, whose logits are cross terms only.
    2. The Markov head maps the previous token ``p`` to a bias that peaks at ``t(p)``, the target's
       next token after ``p`` (:func:`target_next_tokens`): ``w1[p] = u_p`` (unit rows),
       ``w2[j] = DSPARK_MARKOV_SCALE * sum of u_p over the p with t(p) = j``. The bias of ``t(p)`` is
       about the scale, every other one a few cross terms of it; the margin is checked here for
       every token.
    So the drafter proposes ``t(a), t(t(a)), ...``: under greedy decoding the target accepts all of
    them and the accept length is ``block_size + 1``. The context path (fc, context K/V) runs but
    adds nothing: the forward test against the plain-PyTorch reference covers its arithmetic.
    """
    vocab = embeddings.shape[0]
    gen = torch.Generator().manual_seed(seed + 15485863)
    t = target_next_tokens(embeddings, head)
    u = torch.randn(vocab, markov_rank, generator=gen)
    w1 = u / u.norm(dim=-1, keepdim=True)
    w2 = torch.zeros(vocab, markov_rank).index_add_(0, t, DSPARK_MARKOV_SCALE * w1)
    rows = torch.arange(vocab)
    bias = w2.to(torch.bfloat16).float() @ w1.to(torch.bfloat16).float().t()  # [next token, previous token]
    right = bias[t, rows]
    bias[t, rows] = float("-inf")
    margin = float((right - bias.max(0).values).min())
    if margin < DSPARK_MIN_MARGIN:
        raise ValueError(f"seed {seed} gives a Markov margin of {margin:.2f} < {DSPARK_MIN_MARGIN}: the target's "
                         "next-token function has too many tokens with the same successor; build the drafter from "
                         "`make-tiny --agreeing` or `--script`")
    out = {"markov_head.markov_w1.weight": w1, "markov_head.markov_w2.weight": w2}
    for spec in specs:
        if spec.name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
            out[spec.name] = torch.zeros(spec.shape)
        elif spec.name.endswith("norm.weight"):
            out[spec.name] = torch.ones(spec.shape)
    return out
