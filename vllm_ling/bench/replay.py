"""The replay workload: your own chat traffic, one OpenAI chat request per JSONL line.

A line is the body of a ``POST /v1/chat/completions`` request (``messages``, and any of
``tools``, ``tool_choice``, sampling parameters, ``max_tokens``, ``chat_template_kwargs``...)
plus three optional fields that are not sent:

- ``id``: names the request in results and pairs it between two runs (default ``line-N``);
- ``expected``: the answer to score against (see ``scoring.py``: a string, a number, a regex or
  a tool call);
- ``usage``: recorded ``{"prompt_tokens", "completion_tokens"}`` of the original traffic, used
  only as the source of a length distribution (``lengths.py``).

``model``, ``stream`` and ``stream_options`` are set by the harness. Requests go out in file
order or shuffled with ``--seed``; ``--num-requests N`` takes the first N (a seeded sample when
shuffled) or repeats the file until N (reshuffled each pass when shuffled); a repeat is named
``<id>#<pass>``.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from vllm_ling.bench import scoring
from vllm_ling.bench.workloads import BenchRequest

NOT_SENT = ("id", "expected", "usage")
SET_BY_HARNESS = ("model", "stream", "stream_options")


class ReplayError(ValueError):
    """A replay file that cannot be used; the message names the file and line."""


@dataclass
class ReplayLine:
    request_id: str
    body: dict[str, Any]
    expected: scoring.Expected | None
    expected_raw: Any
    usage: dict[str, int] | None
    lineno: int

    @property
    def has_tools(self) -> bool:
        return bool(self.body.get("tools"))


def _check_messages(messages: Any, where: str) -> None:
    if not isinstance(messages, list) or not messages:
        raise ReplayError(f"{where}: 'messages' must be a non-empty list of {{role, content}} objects")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ReplayError(f"{where}: messages[{i}] needs a 'role' (got {str(m)[:80]})")


def _check_usage(usage: Any, where: str) -> dict[str, int] | None:
    if usage is None:
        return None
    ok = isinstance(usage, dict) and all(
        isinstance(usage.get(k), int) and not isinstance(usage.get(k), bool) and usage[k] >= 0
        for k in ("prompt_tokens", "completion_tokens") if k in usage)
    if not ok:
        raise ReplayError(f"{where}: 'usage' must hold whole numbers prompt_tokens/completion_tokens, got {usage!r}")
    return {k: usage[k] for k in ("prompt_tokens", "completion_tokens") if k in usage}


def parse_line(text: str, lineno: int, source: str) -> ReplayLine:
    where = f"{source}:{lineno}"
    try:
        row = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ReplayError(f"{where}: not JSON ({exc})") from exc
    if not isinstance(row, dict):
        raise ReplayError(f"{where}: expected one JSON object (an OpenAI chat request) per line")
    if "prompt" in row and "messages" not in row:
        raise ReplayError(f"{where}: a replay line is a chat request ('messages'), not a completion ('prompt')")
    _check_messages(row.get("messages"), where)
    if "tools" in row and not isinstance(row["tools"], list):
        raise ReplayError(f"{where}: 'tools' must be a list of OpenAI tool definitions")
    if "max_tokens" in row and (not isinstance(row["max_tokens"], int) or row["max_tokens"] < 1):
        raise ReplayError(f"{where}: 'max_tokens' must be a whole number >= 1, got {row['max_tokens']!r}")
    expected = None
    if "expected" in row:
        try:
            expected = scoring.parse_expected(row["expected"])
        except scoring.ExpectedError as exc:
            raise ReplayError(f"{where}: expected: {exc}") from exc
        if expected.kind == "tool_call" and not row.get("tools"):
            raise ReplayError(f"{where}: expected is a tool call but the request declares no 'tools'")
    rid = row.get("id", f"line-{lineno}")
    if not isinstance(rid, (str, int)) or isinstance(rid, bool):
        raise ReplayError(f"{where}: 'id' must be a string or a number, got {rid!r}")
    body = {k: v for k, v in row.items() if k not in NOT_SENT and k not in SET_BY_HARNESS}
    return ReplayLine(str(rid), body, expected, row.get("expected"), _check_usage(row.get("usage"), where), lineno)


def load_replay(path: str) -> list[ReplayLine]:
    """Every request of a replay JSONL (blank lines skipped); ids must be unique."""
    p = Path(path)
    if not p.is_file():
        raise ReplayError(f"--requests {path!r}: file not found")
    lines = []
    seen: dict[str, int] = {}
    for lineno, text in enumerate(p.read_text().splitlines(), 1):
        if not text.strip():
            continue
        line = parse_line(text, lineno, path)
        if line.request_id in seen:
            raise ReplayError(f"{path}:{lineno}: id {line.request_id!r} already used on line {seen[line.request_id]}")
        seen[line.request_id] = lineno
        lines.append(line)
    if not lines:
        raise ReplayError(f"--requests {path!r}: no requests in the file")
    return lines


def schedule(lines: list[ReplayLine], num_requests: int | None, shuffle: bool, seed: int) -> list[tuple[ReplayLine, int]]:
    """(line, pass number) in sending order: the file order or a seeded shuffle, cut or repeated to N."""
    n = len(lines) if num_requests is None else num_requests
    rng = random.Random(seed)
    out: list[tuple[ReplayLine, int]] = []
    pass_no = 1
    while len(out) < n:
        order = list(lines)
        if shuffle:
            rng.shuffle(order)
        out.extend((line, pass_no) for line in order[: n - len(out)])
        pass_no += 1
    return out


def replay_requests(path: str, *, num_requests: int | None, shuffle: bool, seed: int) -> list[BenchRequest]:
    out = []
    for line, pass_no in schedule(load_replay(path), num_requests, shuffle, seed):
        rid = line.request_id if pass_no == 1 else f"{line.request_id}#{pass_no}"
        out.append(BenchRequest(
            request_id=rid, prompt=None, params=dict(line.body), chat=True, expected=line.expected,
            meta={"replay_id": line.request_id, "line": line.lineno, "pass": pass_no,
                  "has_tools": line.has_tools, "expected": line.expected_raw}))
    return out
