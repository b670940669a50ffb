"""Workloads: the list of completion requests a benchmark sends."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any

from vllm_ling.bench import gsm8k

WORKLOADS = ("synthetic", "gsm8k")


@dataclass
class BenchRequest:
    request_id: str
    prompt: str | list[int]
    params: dict[str, Any]  # sampling fields of the /v1/completions body
    gold: str | None = None  # GSM8K gold answer
    meta: dict[str, Any] = field(default_factory=dict)


def synthetic_requests(
    *, num_requests: int, input_len: int, output_len: int, seed: int,
    token_id_low: int = 10, token_id_high: int = 1000,
) -> list[BenchRequest]:
    """Random token-id prompts of exactly `input_len` tokens, greedy, EOS ignored.

    Prompts are sent as token-id lists so their length does not depend on a tokenizer. Ids come
    from [token_id_low, token_id_high): low enough to be valid in any vocabulary (the tiny
    test tokenizer included) and above the usual special-token ids.
    """
    if input_len < 1 or output_len < 1:
        raise ValueError("--input-len and --output-len must be >= 1")
    if not 0 <= token_id_low < token_id_high:
        raise ValueError("--token-id-range needs 0 <= LOW < HIGH")
    rng = random.Random(seed)
    out = []
    for i in range(num_requests):
        ids = [rng.randrange(token_id_low, token_id_high) for _ in range(input_len)]
        out.append(BenchRequest(
            request_id=f"synthetic-{i}",
            prompt=ids,
            params={"max_tokens": output_len, "temperature": 0.0, "ignore_eos": True},
            meta={"input_len": input_len},
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
