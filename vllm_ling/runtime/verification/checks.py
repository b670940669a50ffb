"""The one result type of every check, and the rule that an exception inside a check is that
check's failure (:func:`guarded`), never a crash of the engine."""

from __future__ import annotations

import dataclasses
from typing import Callable

from vllm_ling.log import get_logger, one_line

logger = get_logger("verify")


@dataclasses.dataclass
class Check:
    name: str
    passed: bool
    expected: str
    actual: str
    fix: str = ""

    def and_(self, other: "Check") -> "Check":
        """This row with ``other``'s finding added (a known answer on a layer this row counts):
        it passes only where both do, and names the fix of what failed."""
        return Check(self.name, self.passed and other.passed, f"{self.expected}; {other.expected}",
                     f"{self.actual}; {other.actual}", self.fix if not self.passed or other.passed else other.fix)


def guarded(name: str, run: Callable[[], Check]) -> Check:
    """``run()``; an exception inside a check is that check's failure (traceback at DEBUG), so a
    strict start ends with one refusal line naming it, never a crash of the engine."""
    try:
        return run()
    except Exception as exc:
        logger.debug("verification check %s raised", name, exc_info=True)
        return Check(name, False, "the check completes", f"the check raised {one_line(exc)}",
                     "a defect in the check or in what it inspects: run with VLLM_LING_VERIFY=warn to serve "
                     "anyway, and report the message")
