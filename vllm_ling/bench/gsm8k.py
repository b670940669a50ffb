"""GSM8K: loading questions, the 5-shot chain-of-thought prompt, and answer extraction.

Two extractions, as in lm-evaluation-harness: *strict* accepts only the ``#### N`` form the
exemplars teach; *flexible* takes the last number anywhere in the completion. Numbers are read
by the generic scorer (``scoring.py``): fractions and thousands separators included, so
``#### 3/4`` matches a gold 0.75 and ``1,234`` is 1234 (but ``1,2,3`` is three numbers).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from vllm_ling.bench import scoring

# Training-style exemplars written for this harness (not test questions), in GSM8K's
# answer format: reasoning, then "#### <number>".
EXEMPLARS: list[tuple[str, str]] = [
    ("A baker makes 24 muffins in the morning and 18 in the afternoon. She sells 30 of them. "
     "How many muffins are left?",
     "She makes 24 + 18 = 42 muffins. After selling 30 she has 42 - 30 = 12 left.\n#### 12"),
    ("Tom buys 3 notebooks at $4 each and a pen for $2. He pays with a $20 bill. "
     "How much change does he get?",
     "The notebooks cost 3 * 4 = $12. With the pen he spends 12 + 2 = $14. "
     "His change is 20 - 14 = $6.\n#### 6"),
    ("A train travels 60 miles per hour for 2.5 hours. How many miles does it travel?",
     "Distance is speed times time: 60 * 2.5 = 150 miles.\n#### 150"),
    ("Maria has 5 boxes with 12 pencils each. She gives a third of all the pencils to her "
     "brother. How many pencils does she keep?",
     "She has 5 * 12 = 60 pencils. A third is 60 / 3 = 20, so she keeps 60 - 20 = 40.\n#### 40"),
    ("The temperature was 7 degrees in the morning and fell 12 degrees by midnight. "
     "What was the temperature at midnight?",
     "It fell from 7 by 12 degrees: 7 - 12 = -5 degrees.\n#### -5"),
]

SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 29}


@dataclass
class Question:
    qid: str
    question: str
    answer: str  # normalized gold number as a string


class DatasetError(ValueError):
    pass


def normalize_number(text: str | None) -> str | None:
    """Canonical form of a numeric answer (``scoring.normalize_number``): 18.0 == 18, 3/4 == 0.75."""
    return scoring.normalize_number(text)


def extract_strict(completion: str) -> str | None:
    """The number after the first ``####`` (GSM8K's answer marker), or None."""
    value = scoring.marked_number(completion)
    return None if value is None else scoring.canonical_number(value)


def extract_flexible(completion: str) -> str | None:
    """The last number in the completion (before any new "Question:" the model invents)."""
    value = scoring.last_number(completion.split("\nQuestion:", 1)[0])
    return None if value is None else scoring.canonical_number(value)


def gold_answer(answer_field: str) -> str:
    """Gold number from a GSM8K answer field ("... #### 18")."""
    value = extract_strict(answer_field)
    if value is None:
        value = normalize_number(answer_field)
    if value is None:
        raise DatasetError(f"cannot read a gold number from answer {answer_field!r}")
    return value


def load_questions(path: str | None = None) -> list[Question]:
    """Questions from a jsonl with ``question`` and ``answer`` (or ``short_answer``) fields."""
    if path is None:
        text = (resources.files("vllm_ling") / "data" / "gsm8k_test.jsonl").read_text()
        source = "packaged gsm8k_test.jsonl"
    else:
        p = Path(path)
        if not p.is_file():
            raise DatasetError(f"--dataset {path!r}: file not found")
        text = p.read_text()
        source = path
    questions = []
    for lineno, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            q = row["question"]
            ans = row.get("short_answer") or row["answer"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise DatasetError(f"{source}:{lineno}: expected a JSON object with 'question' and "
                               f"'answer' ({exc})") from exc
        qid = str(row.get("id", lineno - 1))
        questions.append(Question(qid, q, gold_answer(str(ans))))
    if not questions:
        raise DatasetError(f"{source}: no questions")
    return questions


def load_hf_questions() -> list[Question]:
    """The GSM8K test split from the Hugging Face hub (needs `datasets` and network)."""
    try:
        import datasets  # noqa: PLC0415
    except ImportError as exc:
        raise DatasetError("--hf-dataset needs the 'datasets' package (pip install datasets)") from exc
    ds = datasets.load_dataset("openai/gsm8k", "main", split="test")
    return [Question(str(i), r["question"], gold_answer(r["answer"])) for i, r in enumerate(ds)]


def exemplars_from_file(path: str, n: int = 5) -> list[tuple[str, str]]:
    """The first `n` rows of a jsonl (question, full answer with reasoning) as exemplars."""
    p = Path(path)
    if not p.is_file():
        raise DatasetError(f"--fewshot {path!r}: file not found")
    shots = []
    for line in p.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            shots.append((row["question"], row["answer"]))
        if len(shots) == n:
            break
    if len(shots) < n:
        raise DatasetError(f"--fewshot {path!r}: needs {n} rows, found {len(shots)}")
    return shots


def build_prompt(question: str, exemplars: list[tuple[str, str]] | None = None) -> str:
    shots = EXEMPLARS if exemplars is None else exemplars
    parts = [f"Question: {q}\nAnswer: {a}\n\n" for q, a in shots]
    parts.append(f"Question: {question}\nAnswer:")
    return "".join(parts)


def score(completion: str, gold: str) -> dict:
    strict = extract_strict(completion)
    flexible = extract_flexible(completion)
    return {
        "extracted_strict": strict,
        "extracted_flexible": flexible,
        "correct_strict": strict == gold,
        "correct_flexible": flexible == gold,
    }
