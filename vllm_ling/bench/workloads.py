"""Workloads: the list of requests a benchmark sends (completions; chat for replay)."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm_ling.bench import gsm8k

WORKLOADS = ("synthetic", "gsm8k", "replay")


@dataclass
class BenchRequest:
    request_id: str
    prompt: str | list[int] | None
    params: dict[str, Any]  # the body's other fields (sampling; for chat also messages, tools...)
    gold: str | None = None  # GSM8K gold answer
    meta: dict[str, Any] = field(default_factory=dict)
    chat: bool = False  # sent to /v1/chat/completions (params hold the messages)
    expected: Any = None  # scoring.Expected for replay requests with an ``expected`` answer


def synthetic_requests(
    *, num_requests: int, input_len: int, output_len: int, seed: int,
    token_id_low: int = 10, token_id_high: int = 1000,
    input_lens: list[int] | None = None, output_lens: list[int] | None = None,
) -> list[BenchRequest]:
    """Random token-id prompts, greedy, EOS ignored: `input_len` prompt tokens and `output_len`
    output tokens each, or per request `input_lens[i]` / `output_lens[i]` (``lengths.draw``).

    Prompts are sent as token-id lists so their length does not depend on a tokenizer. Ids come
    from [token_id_low, token_id_high): low enough to be valid in any vocabulary (the tiny
    test tokenizer included) and above the usual special-token ids.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    if not 0 <= token_id_low < token_id_high:
        raise ValueError("--token-id-range needs 0 <= LOW < HIGH")
    rng = random.Random(seed)
    inputs = input_lens if input_lens is not None else [input_len] * num_requests
    outputs = output_lens if output_lens is not None else [output_len] * num_requests
    out = []
    for i in range(num_requests):
        ids = [rng.randrange(token_id_low, token_id_high) for _ in range(inputs[i])]
        out.append(BenchRequest(
            request_id=f"synthetic-{i}",
            prompt=ids,
            params={"max_tokens": outputs[i], "temperature": 0.0, "ignore_eos": True},
            meta={"input_len": inputs[i], "output_len": outputs[i]},
        ))
    return out


def gsm8k_requests(
    *, num_requests: int | None, max_tokens: int, seed: int, dataset: str | None = None,
    fewshot: str | None = None, hf_dataset: bool = False,
) -> list[BenchRequest]:
    """GSM8K questions with the 5-shot CoT prompt and the study's sampling (T 0.6, p 0.95, k 29).

    The per-request seed is `seed` + question index, so a rerun samples the same way on a
    server that honours seeds.
    """
    questions = gsm8k.load_hf_questions() if hf_dataset else gsm8k.load_questions(dataset)
    shots = gsm8k.exemplars_from_file(fewshot) if fewshot else None
    if num_requests is not None:
        questions = questions[:num_requests]
    out = []
    for i, q in enumerate(questions):
        out.append(BenchRequest(
            request_id=f"gsm8k-{q.qid}",
            prompt=gsm8k.build_prompt(q.question, shots),
            params={"max_tokens": max_tokens, **gsm8k.SAMPLING, "seed": seed + i,
                    "stop": ["Question:"]},
            gold=q.answer,
            meta={"question_id": q.qid},
        ))
    return out
