"""Prometheus ``/metrics`` scraping and speculative-decoding deltas over a run."""

from __future__ import annotations

import re
from typing import Any

DRAFTS = "vllm:spec_decode_num_drafts_total"
ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
ACCEPTED_PER_POS = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"

_SAMPLE = re.compile(
    r"^(?P<name>[a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(?P<labels>[^}]*)\})?\s+(?P<value>\S+)(?:\s+\S+)?$")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_prometheus(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) for every sample line of the Prometheus text format."""
    samples = []
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = _SAMPLE.match(line)
        if not m:
            continue
        try:
            value = float(m.group("value"))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group("labels") or ""))
        samples.append((m.group("name"), labels, value))
    return samples


def spec_counters(text: str) -> dict[str, Any]:
    """Spec-decode counters summed over every label set (e.g. several engines or models)."""
    drafts = accepted = draft_tokens = 0.0
    per_pos: dict[int, float] = {}
    found = False
    for name, labels, value in parse_prometheus(text):
        if name == DRAFTS:
            drafts += value
            found = True
        elif name == ACCEPTED:
            accepted += value
            found = True
        elif name == DRAFT_TOKENS:
            draft_tokens += value
        elif name == ACCEPTED_PER_POS and "position" in labels:
            pos = int(labels["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + value
    return {"found": found, "drafts": drafts, "accepted": accepted, "draft_tokens": draft_tokens,
            "per_position": per_pos}


def spec_decode_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any] | None:
    """Accept length and per-position acceptance over the run, or None without speculation.

    accept length = 1 + accepted / drafts (each verify step emits the accepted drafts plus one
    token of its own); per-position rate i = accepted_at_position_i / drafts.
    """
    if not after.get("found"):
        return None
    drafts = after["drafts"] - before.get("drafts", 0.0)
    accepted = after["accepted"] - before.get("accepted", 0.0)
    if drafts <= 0:
        return None
    positions = sorted(after["per_position"])
    per_pos = [
        (after["per_position"][p] - before.get("per_position", {}).get(p, 0.0)) / drafts
        for p in positions
    ]
    draft_tokens = after["draft_tokens"] - before.get("draft_tokens", 0.0)
    return {
        "drafts": drafts,
        "accepted_tokens": accepted,
        "draft_tokens": draft_tokens,
        "accept_length": 1.0 + accepted / drafts,
        "per_position_accept_rate": per_pos,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens > 0 else None,
    }
