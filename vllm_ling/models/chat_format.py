"""The Ling-3 chat format as the tiny checkpoints carry it: marker tokens and the Jinja template.

vLLM's ``ling3`` parsers (``vllm/parser/ling3.py``, GLM-4.7 markup) find ``<think>``,
``</think>``, ``<tool_call>`` and ``</tool_call>`` by token id when the vocabulary has them as
single tokens, and by text otherwise; the real Ling-3 vocabulary has them as single tokens, so
the tiny tokenizer does too (the last ids of its vocabulary, after the trained BPE pieces).
Role markers and the end-of-turn ``<|role_end|>`` are special tokens (hidden from output text,
like EOS); the reasoning and tool-call markers are ordinary added tokens, so they reach the
parsers as text as well.
"""

from __future__ import annotations

from pathlib import Path

DATA_DIR = Path(__file__).resolve().parent.parent / "data"
TEMPLATE_PATH = DATA_DIR / "ling3_chat_template.jinja"

ROLE_END = "<|role_end|>"
THINK_START, THINK_END = "<think>", "</think>"
TOOL_CALL_START, TOOL_CALL_END = "<tool_call>", "</tool_call>"
SPECIAL_MARKERS = (ROLE_END, "<role>", "</role>")
TEXT_MARKERS = (THINK_START, THINK_END, TOOL_CALL_START, TOOL_CALL_END, "<arg_key>", "</arg_key>",
                "<arg_value>", "</arg_value>", "<tool_response>", "</tool_response>")
MARKERS = SPECIAL_MARKERS + TEXT_MARKERS


def chat_template() -> str:
    return TEMPLATE_PATH.read_text()


def marker_ids(vocab_size: int) -> dict[str, int]:
    """Ids of the markers in a tiny tokenizer of ``vocab_size`` (they are its last ids)."""
    first = vocab_size - len(MARKERS)
    return {m: first + i for i, m in enumerate(MARKERS)}


def add_markers(tokenizer, vocab_size: int) -> None:
    """Append the markers to a ``tokenizers.Tokenizer`` holding ``vocab_size - len(MARKERS)``
    ids, so they take the last ids of the vocabulary."""
    from tokenizers import AddedToken

    if tokenizer.get_vocab_size() != vocab_size - len(MARKERS):
        raise ValueError(f"tokenizer has {tokenizer.get_vocab_size()} ids; the markers need it to "
                         f"hold exactly {vocab_size - len(MARKERS)} before they are added")
    tokenizer.add_special_tokens([AddedToken(m, special=True, normalized=False) for m in SPECIAL_MARKERS])
    tokenizer.add_tokens([AddedToken(m, special=False, normalized=False) for m in TEXT_MARKERS])
    expected = marker_ids(vocab_size)
    got = {m: tokenizer.token_to_id(m) for m in MARKERS}
    if got != expected:
        raise RuntimeError(f"marker tokens got ids {got}, expected {expected}")


def generation_prompt_last_marker(thinking: bool) -> str:
    """The token the template's generation prompt ends with (where the model's output starts)."""
    return THINK_START if thinking else THINK_END
