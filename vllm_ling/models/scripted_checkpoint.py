"""Weights for ``vllm-ling make-tiny --script TEXT``: a tiny checkpoint whose greedy answer to a
chat prompt is TEXT, and whose NEXTN draft predicts every token of it.

It is the agreeing checkpoint (see ``agreeing_checkpoint``: every block writes nothing to the
residual stream, so the target's next token is a function of the current token only, and the
NEXTN layer predicts that function one position ahead) with a different function: a *chain*
``s0 -> s1 -> ... -> sn -> <|role_end|>`` where ``s0`` is the token the chat template's
generation prompt ends with (``<think>``; ``</think>`` with thinking off) and ``s1..sn`` spell
TEXT. The head row of ``j`` is the sum of the embeddings of the tokens whose successor is ``j``;
tokens off the chain keep the agreeing permutation. Because the successor depends on the current
token alone, a token can start at most one step of the chain: every token of the chain must be
distinct (a repeated token would loop forever). :func:`plan_chain` therefore searches the
tokenizer's vocabulary for a spelling of TEXT with distinct tokens (longer pieces first,
backtracking), and says so when there is none: repeated markup such as two ``<arg_key>`` cannot
be spelled, so a scripted tool call has one argument.
"""

from __future__ import annotations

import re
from typing import Any

import torch

from vllm_ling.models.chat_format import (ROLE_END, SPECIAL_MARKERS, TEXT_MARKERS,
                                        generation_prompt_last_marker, marker_ids)

SEARCH_BUDGET = 200_000  # explored prefixes before plan_chain gives up

# The demo's and the end-to-end test's script: reasoning, then one tool call (one argument:
# a second <arg_key> would repeat a token).
EXAMPLE_REASONING = "The user wants to know the weather in Paris, so I will call a tool."
EXAMPLE_TOOL_CALL = ("get_weather", {"city": "Paris"})
EXAMPLE_SCRIPT = (f"{EXAMPLE_REASONING}</think><tool_call>{EXAMPLE_TOOL_CALL[0]}<arg_key>city</arg_key>"
                  f"<arg_value>{EXAMPLE_TOOL_CALL[1]['city']}</arg_value></tool_call>")


class ScriptError(ValueError):
    """The script cannot be spelled as a chain of distinct tokens (the message says why)."""


def _pieces(tokenizer, special_ids: set[int]) -> dict[str, list[int]]:
    """Decoded text -> token ids, for every token that decodes on its own to clean text."""
    by_text: dict[str, list[int]] = {}
    for tid in range(len(tokenizer)):
        if tid in special_ids:
            continue
        text = tokenizer.decode([tid])
        if text and "\ufffd" not in text:
            by_text.setdefault(text, []).append(tid)
    return by_text


def plan_chain(tokenizer, text: str, vocab_size: int, thinking: bool = True,
               special_ids: set[int] | None = None) -> list[int]:
    """Token ids ``[s0, s1, ..., sn, <|role_end|>]``: ``s0`` ends the generation prompt,
    ``s1..sn`` decode to ``text``, and no id repeats."""
    markers = marker_ids(vocab_size)
    start, end = markers[generation_prompt_last_marker(thinking)], markers[ROLE_END]
    for m in SPECIAL_MARKERS:
        if m in text:
            raise ScriptError(f"the script must not contain {m}: role markup and the end of the turn "
                              "come from the chat template")
    # Ordinary pieces only: a marker in the text must be its marker token (the parsers look
    # for that id), and no ordinary piece may spell part of a marker.
    by_text = _pieces(tokenizer, set(range(3)) | set(markers.values()) | set(special_ids or ()))
    in_marker = [False] * len(text)
    forced_at: dict[int, int] = {}
    for m in TEXT_MARKERS:
        for hit in re.finditer(re.escape(m), text):
            forced_at[hit.start()] = markers[m]
            for i in range(hit.start(), hit.end()):
                in_marker[i] = True
    candidates_at: list[list[int]] = []
    for pos in range(len(text)):
        if pos in forced_at:
            candidates_at.append([forced_at[pos]])
            continue
        found: list[int] = []
        if not in_marker[pos]:
            stop = pos
            while stop < len(text) and not in_marker[stop] and stop - pos < 24:
                stop += 1
            for length in range(stop - pos, 0, -1):
                found += by_text.get(text[pos:pos + length], [])
        candidates_at.append(found)
    lengths = {tid: len(tokenizer.decode([tid])) for ids in candidates_at for tid in ids}
    used = {start, end}
    chain: list[int] = []
    budget = [SEARCH_BUDGET]
    furthest = [0]

    def search(pos: int) -> bool:
        furthest[0] = max(furthest[0], pos)
        if pos == len(text):
            return True
        budget[0] -= 1
        if budget[0] < 0:
            return False
        for tid in candidates_at[pos]:
            if tid in used:
                continue
            used.add(tid)
            chain.append(tid)
            if search(pos + lengths[tid]):
                return True
            used.discard(tid)
            chain.pop()
        return False

    if not text:
        raise ScriptError("the script is empty")
    if not search(0):
        raise ScriptError(
            "cannot spell the script with distinct tokens of the tiny tokenizer: each token can "
            "appear once in the chain (the model's next token depends on the current token only). "
            "Repeat less: e.g. one argument per tool call, fewer repeated words or punctuation. "
            f"No spelling gets past {text[:furthest[0]]!r} (then {text[furthest[0]:furthest[0] + 12]!r}).")
    if tokenizer.decode(chain) != text:
        raise ScriptError(f"the planned tokens decode to {tokenizer.decode(chain)!r}, not {text!r}")
    return [start] + chain + [end]


def successor_table(base: torch.Tensor, chain: list[int]) -> torch.Tensor:
    """``base`` (the agreeing permutation, -1 = no successor) with the chain's steps put in."""
    succ = base.clone()
    for a, b in zip(chain, chain[1:]):
        succ[a] = b
    return succ


def head_for_successors(embeddings: torch.Tensor, succ: torch.Tensor) -> torch.Tensor:
    """Head rows: ``W[j] = sum of E[v] over v with succ[v] = j``, so token v's argmax is succ[v]
    (a few summed rows keep the margin: cross terms of independent rows are ~sqrt(H) smaller)."""
    head = torch.zeros_like(embeddings)
    has = succ >= 0
    head.index_add_(0, succ[has], embeddings[has])
    return head


def scripted_overrides(config: dict[str, Any], chain: list[int], seed: int = 0) -> dict[str, torch.Tensor]:
    from vllm_ling.models.agreeing_checkpoint import agreeing_overrides, next_token_permutation

    out = agreeing_overrides(config, seed)
    succ = successor_table(next_token_permutation(config["vocab_size"], seed), chain)
    out["lm_head.weight"] = head_for_successors(out["model.word_embeddings.weight"], succ)
    return out


def greedy_walk(config: dict[str, Any], chain: list[int], start: int, steps: int,
                seed: int = 0) -> list[int]:
    """The tokens the scripted target emits after a prompt ending in ``start`` (stops after
    ``<|role_end|>``)."""
    from vllm_ling.models.agreeing_checkpoint import next_token_permutation

    succ = successor_table(next_token_permutation(config["vocab_size"], seed), chain)
    end = marker_ids(config["vocab_size"])[ROLE_END]
    out, t = [], start
    for _ in range(steps):
        t = int(succ[t])
        out.append(t)
        if t == end or t < 0:
            break
    return out
