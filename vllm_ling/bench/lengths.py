"""Length distributions for the synthetic workload: what input and output lengths to send.

``--input-len-dist`` / ``--output-len-dist`` take one of

- a list ``128,256,1024`` (each value equally likely) or ``128:6,1024:3,8192:1`` (weights);
- a file: a replay JSONL (its lines' recorded ``usage.prompt_tokens`` / ``completion_tokens``;
  lacking those, ``max_tokens`` for outputs and about 4 characters per token of the messages
  for inputs, reported as estimated) or a ``results.json`` of an earlier run (the prompt and
  output tokens each request really had, from the server's ``usage``).

Each request draws its lengths independently from a seeded generator; the report shows the
lengths actually sent (:func:`histogram`).
"""

from __future__ import annotations

import json
import math
import random
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

CHARS_PER_TOKEN = 4  # rough English BPE ratio, used only when a replay line records no usage


class LengthSpecError(ValueError):
    pass


@dataclass(frozen=True)
class LengthDistribution:
    values: tuple[int, ...]
    weights: tuple[float, ...]
    source: str  # how it was given, for the report
    estimated: bool = False  # values derived from characters, not token counts

    def sample(self, n: int, rng: random.Random) -> list[int]:
        return rng.choices(self.values, weights=self.weights, k=n)


_LIST = re.compile(r"^\s*\d+(?::\d+(?:\.\d+)?)?(?:\s*,\s*\d+(?::\d+(?:\.\d+)?)?)*\s*$")


def _from_counts(counts: Counter, source: str, estimated: bool = False) -> LengthDistribution:
    items = sorted(counts.items())
    return LengthDistribution(tuple(v for v, _ in items), tuple(float(c) for _, c in items), source, estimated)


def _text_chars(content: Any) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # OpenAI content parts
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def _from_replay(path: Path, which: str, flag: str) -> LengthDistribution:
    from vllm_ling.bench.replay import ReplayError, load_replay  # noqa: PLC0415

    try:
        lines = load_replay(str(path))
    except ReplayError as exc:
        raise LengthSpecError(f"{flag} {path}: {exc}") from exc
    key = "prompt_tokens" if which == "input" else "completion_tokens"
    counts: Counter = Counter()
    estimated = False
    for line in lines:
        if line.usage and key in line.usage:
            value = line.usage[key]
        elif which == "output":
            if "max_tokens" not in line.body:
                raise LengthSpecError(f"{flag} {path}:{line.lineno}: no usage.completion_tokens and no "
                                      "max_tokens to take an output length from")
            value = line.body["max_tokens"]
        else:
            estimated = True
            chars = sum(_text_chars(m.get("content")) for m in line.body["messages"])
            value = max(1, math.ceil(chars / CHARS_PER_TOKEN))
        counts[max(1, int(value))] += 1
    return _from_counts(counts, f"{path} ({len(lines)} replay lines, {which} lengths"
                        + (f", estimated at {CHARS_PER_TOKEN} characters per token" if estimated else "")
                        + ")", estimated)


def _from_results(data: dict, path: Path, which: str, flag: str) -> LengthDistribution:
    key = "prompt_tokens" if which == "input" else "output_tokens"
    counts = Counter(int(r[key]) for r in data.get("requests", []) if r.get("ok") and r.get(key))
    if not counts:
        raise LengthSpecError(f"{flag} {path}: no successful request with {key} in this results.json")
    return _from_counts(counts, f"{path} ({sum(counts.values())} measured requests, {which} lengths)")


def parse_length_spec(spec: str, which: str, flag: str) -> LengthDistribution:
    """A length distribution from ``--input-len-dist`` / ``--output-len-dist`` (``which``: input|output)."""
    if _LIST.match(spec):
        counts: Counter = Counter()
        for part in spec.split(","):
            value, _, weight = part.strip().partition(":")
            if int(value) < 1:
                raise LengthSpecError(f"{flag}: lengths must be >= 1, got {value}")
            w = float(weight) if weight else 1.0
            if w <= 0:
                raise LengthSpecError(f"{flag}: weights must be > 0, got {part.strip()!r}")
            counts[int(value)] += w
        return LengthDistribution(tuple(sorted(counts)), tuple(counts[v] for v in sorted(counts)), spec)
    path = Path(spec)
    if not path.is_file():
        raise LengthSpecError(f"{flag} {spec!r}: neither a list (128,256 or 128:3,256:1) nor an existing file")
    text = path.read_text()
    try:
        data = json.loads(text)
    except json.JSONDecodeError:
        data = None
    if isinstance(data, dict) and "requests" in data and "schema" in data:
        return _from_results(data, path, which, flag)
    return _from_replay(path, which, flag)


def draw(input_dist: LengthDistribution | None, output_dist: LengthDistribution | None, n: int,
         seed: int) -> tuple[list[int] | None, list[int] | None]:
    """Per-request (input, output) lengths; None where no distribution is given. A generator of
    their own keeps the prompts' token draws the same whether or not a distribution is used."""
    rng = random.Random(f"lengths:{seed}")
    return (input_dist.sample(n, rng) if input_dist else None,
            output_dist.sample(n, rng) if output_dist else None)


def histogram(values: list[int], max_bins: int = 12) -> list[dict[str, int]]:
    """Rows ``{low, high, count}`` of the lengths sent: one per value when few, else powers of two."""
    if not values:
        return []
    distinct = sorted(set(values))
    if len(distinct) <= max_bins:
        c = Counter(values)
        return [{"low": v, "high": v, "count": c[v]} for v in distinct]
    rows: dict[int, int] = Counter(max(0, int(math.log2(v))) if v > 0 else 0 for v in values)
    return [{"low": 2 ** k, "high": 2 ** (k + 1) - 1, "count": rows[k]} for k in sorted(rows)]
