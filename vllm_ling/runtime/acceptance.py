"""MTP accept length over a sliding window of drafts, and the collapse guard.

Window: the most recent scheduler steps that together hold at least
``VLLM_LING_ACCEPT_WINDOW`` drafts (default 256); a step's drafts are never split, so the
window exceeds N by less than one step's drafts.

Guard: once the window is full, an accept length below ``VLLM_LING_ACCEPT_BREAK_EVEN``
(default 2.26: the study's MTP verify step costs 2.26 normal decode steps at batch 1, so
speculation pays off only above that accept length) starts a *collapse episode*: one
WARNING with the counts and one increment of ``accept_collapse_total``. The episode ends
(one INFO line) when the windowed accept length is back at or above the threshold.

Plain Python: unit-tested without a server.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass
from typing import Callable

from vllm_ling.log import get_logger
from vllm_ling.options import read

logger = get_logger("metrics")

ENV_ACCEPT_WINDOW = "VLLM_LING_ACCEPT_WINDOW"
ENV_BREAK_EVEN = "VLLM_LING_ACCEPT_BREAK_EVEN"


def accept_window_from_env() -> int:
    return read(ENV_ACCEPT_WINDOW)


def break_even_from_env() -> float:
    return float(read(ENV_BREAK_EVEN))


def break_even_for(spec_method: str | None, num_spec_tokens: int) -> float:
    """The guard's threshold: VLLM_LING_ACCEPT_BREAK_EVEN when set; else the served method's own
    break-even (DSpark's verify window and draft cycle cost more than MTP's: spec_policy)."""
    import os

    from vllm_ling.runtime.spec_policy import VLLM_DSPARK_METHOD, dspark_break_even

    if os.environ.get(ENV_BREAK_EVEN, "").strip() or spec_method != VLLM_DSPARK_METHOD or num_spec_tokens < 1:
        return break_even_from_env()
    return dspark_break_even(num_spec_tokens)


@dataclass(frozen=True)
class _Step:
    drafts: int
    draft_tokens: int
    accepted: int
    accepted_per_pos: tuple[int, ...]


class AcceptWindow:
    """Sums of vLLM's per-step spec-decode stats over the most recent ``size`` drafts."""

    def __init__(self, size: int, num_positions: int):
        if size < 1:
            raise ValueError(f"accept window must hold at least one draft, got {size}")
        self.size = size
        self.num_positions = num_positions
        self._steps: deque[_Step] = deque()
        self.drafts = 0
        self.draft_tokens = 0
        self.accepted = 0
        self.accepted_per_pos = [0] * num_positions

    def add(self, drafts: int, draft_tokens: int, accepted: int,
            accepted_per_pos: list[int] | tuple[int, ...]) -> None:
        if drafts <= 0:
            return
        per_pos = tuple(accepted_per_pos[: self.num_positions])
        per_pos += (0,) * (self.num_positions - len(per_pos))
        self._push(_Step(drafts, draft_tokens, accepted, per_pos), +1)
        # Drop the oldest step while the rest still covers the window.
        while self._steps and self.drafts - self._steps[0].drafts >= self.size:
            self._push(self._steps[0], -1)

    def _push(self, step: _Step, sign: int) -> None:
        if sign > 0:
            self._steps.append(step)
        else:
            self._steps.popleft()
        self.drafts += sign * step.drafts
        self.draft_tokens += sign * step.draft_tokens
        self.accepted += sign * step.accepted
        for pos, n in enumerate(step.accepted_per_pos):
            self.accepted_per_pos[pos] += sign * n

    @property
    def full(self) -> bool:
        return self.drafts >= self.size

    @property
    def accept_length(self) -> float | None:
        """Mean tokens emitted per verify step, bonus token included (vLLM's convention)."""
        return 1.0 + self.accepted / self.drafts if self.drafts else None

    def per_position_rates(self) -> list[float] | None:
        """Fraction of drafts whose token at each position was accepted."""
        if not self.drafts:
            return None
        return [n / self.drafts for n in self.accepted_per_pos]


class CollapseGuard:
    """Episode logic: one WARNING and one count when a full window drops below break-even."""

    def __init__(self, break_even: float, engine: int = 0,
                 on_collapse: Callable[[], None] | None = None,
                 log: logging.Logger = logger):
        self.break_even = break_even
        self.engine = engine
        self.on_collapse = on_collapse
        self.log = log
        self.in_episode = False
        self.episodes = 0

    def update(self, window: AcceptWindow) -> str | None:
        """Return "collapse" when an episode starts, "recovered" when it ends, else None."""
        accept_length = window.accept_length
        if accept_length is None or not window.full:
            return None
        if not self.in_episode and accept_length < self.break_even:
            self.in_episode = True
            self.episodes += 1
            if self.on_collapse is not None:
                self.on_collapse()
            self.log.warning(
                "MTP accept length collapsed on engine %d: %.3f over the last %d drafts "
                "(%d of %d draft tokens accepted) is below the break-even %.2f (%s), so "
                "speculative decoding now costs more than it saves. Check GET /vllm_ling/report "
                "and that the draft shares the target's LM-head module; collapse episode %d, "
                "logged once until the window recovers.",
                self.engine, accept_length, window.drafts, window.accepted, window.draft_tokens,
                self.break_even, ENV_BREAK_EVEN, self.episodes)
            return "collapse"
        if self.in_episode and accept_length >= self.break_even:
            self.in_episode = False
            self.log.info(
                "MTP accept length recovered on engine %d: %.3f over the last %d drafts "
                "(%d of %d draft tokens accepted) is at or above the break-even %.2f; "
                "collapse episode %d ended.",
                self.engine, accept_length, window.drafts, window.accepted, window.draft_tokens,
                self.break_even, self.episodes)
            return "recovered"
        return None
