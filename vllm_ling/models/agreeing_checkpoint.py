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
