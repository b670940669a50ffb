"""Startup smoke check: one short greedy generation through the draft/verify path.

``vllm-ling serve`` runs it once the server is healthy: a fixed prompt, greedy, 64 new
tokens, and the accept length from the server's own ``vllm:spec_decode_*`` counters
(deltas over the request). Below ``VLLM_LING_SMOKE_MIN_ACCEPT`` (default 1.5: a working
NEXTN draft on the real model accepts well above it; a draft that shares only the head's
weight tensor sits at 1.0) it fails per ``VLLM_LING_VERIFY``: ``strict`` stops the server,
``warn`` logs a WARNING. The result is written into the report's ``smoke`` field.
Without speculation there is nothing to measure and the check records ``passed: null``; so does a
random-weight tiny checkpoint (``vllm-ling make-tiny`` without ``--agreeing``/``--script``, marked
in its config.json), whose draft cannot be accepted: its accept length is recorded with a note.
No vLLM import (HTTP only).
"""

from __future__ import annotations

import dataclasses
import json
import os
import urllib.request
from pathlib import Path

from vllm_ling.models.names import TINY_WEIGHTS_KEY
from vllm_ling.options import option
from vllm_ling.runtime.report import update_report

SMOKE_PROMPT = ("Question: Natalia sold clips to 48 of her friends in April, and then she sold "
                "half as many clips in May. How many clips did Natalia sell altogether?\nAnswer:")
SMOKE_TOKENS = 64


class SmokeError(RuntimeError):
    pass


@dataclasses.dataclass
class SmokeResult:
    accept_length: float | None
    drafts: int
    threshold: float
    passed: bool | None
    note: str | None = None  # why the accept length is not judged (passed is then None)

    def as_report(self) -> dict:
        report = {"accept_length": self.accept_length, "threshold": self.threshold, "passed": self.passed,
                  "drafts": self.drafts}
        if self.note:
            report["note"] = self.note
        return report


def random_draft_note(model: str | os.PathLike) -> str | None:
    """Why no draft of this checkpoint can be accepted, when its config.json says its weights are
    random (``vllm-ling make-tiny`` without --agreeing or --script); None otherwise."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or config.get(TINY_WEIGHTS_KEY) != "random":
        return None
    return (f"{model} is a random-weight tiny checkpoint (vllm-ling make-tiny without --agreeing or "
            "--script): its NEXTN draft cannot predict the target, so no draft is accepted; the accept "
            "length is not judged (make-tiny --agreeing or --script makes drafts that are accepted)")


def judged(result: SmokeResult, model: str | os.PathLike) -> SmokeResult:
    """``result``, or, when it failed on a checkpoint whose drafts cannot be accepted, the same
    measurement with a note instead of a verdict."""
    note = random_draft_note(model) if result.passed is False else None
    return dataclasses.replace(result, passed=None, note=note) if note else result


def _get(url: str, headers: dict, timeout: float = 30) -> str:
    with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=timeout) as r:
        return r.read().decode()


def spec_counters(base_url: str, headers: dict | None = None) -> tuple[float, float]:
    drafts = accepted = 0.0
    for line in _get(base_url + "/metrics", headers or {}).splitlines():
        if line.startswith("vllm:spec_decode_num_drafts_total"):
            drafts += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:spec_decode_num_accepted_tokens_total"):
            accepted += float(line.rsplit(" ", 1)[1])
    return drafts, accepted


def run_smoke(base_url: str, model: str, api_key: str | None = None,
              threshold: float = option("VLLM_LING_SMOKE_MIN_ACCEPT").default, timeout: float = 600) -> SmokeResult:
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    d0, a0 = spec_counters(base_url)
    body = json.dumps({"model": model, "prompt": SMOKE_PROMPT, "max_tokens": SMOKE_TOKENS,
                       "temperature": 0, "ignore_eos": True}).encode()
    req = urllib.request.Request(base_url + "/v1/completions", data=body, headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as r:
        json.loads(r.read())
    d1, a1 = spec_counters(base_url)
    drafts = int(d1 - d0)
    if drafts == 0:
        return SmokeResult(None, 0, threshold, None)
    accept = 1.0 + (a1 - a0) / drafts
    return SmokeResult(accept, drafts, threshold, accept >= threshold)


def record_in_report(path: str | None, result: SmokeResult) -> None:
    """Merge the smoke result into the startup report."""
    def merge(report: dict) -> None:
        report["smoke"] = result.as_report()
        if result.passed is False:
            report["passed"] = False
            report.setdefault("checks", []).append({
                "name": "smoke_accept_length", "passed": False,
                "expected": f"accept length >= {result.threshold}",
                "actual": f"{result.accept_length:.2f} over {result.drafts} drafts",
                "fix": "the draft does not predict the target: check draft_shares_target_modules"})

    update_report(path, merge)
