"""``VLLM_LING_VERIFY``: ``strict`` (the default) refuses to serve on a failed check, naming each
and its fix in one line; ``warn`` logs each failed check at WARNING; ``off`` skips the checks."""

from __future__ import annotations

from typing import Any

from vllm_ling.log import get_logger
from vllm_ling.options import VerifyPolicy
from vllm_ling.refusal import Refusal

logger = get_logger("verify")


class LingVerificationError(Refusal, RuntimeError):
    """A requested optimization is not active (policy strict); a refusal (vllm_ling.refusal): the
    message names the fix, so it is the launcher's last line and its traceback stays at DEBUG."""


def enforce_policy(report: dict[str, Any], policy: str) -> None:
    """strict: raise naming every failed check and its fix; warn: one WARNING per check."""
    if report["passed"] or policy == VerifyPolicy.OFF:
        return
    failed = [c for c in report["checks"] if not c["passed"]]
    if policy == VerifyPolicy.STRICT:
        message = "; ".join(f"{c['name']}: expected {c['expected']}, got {c['actual']}. Fix: {c['fix']}"
                            for c in failed)
        raise LingVerificationError(
            f"vllm-ling refuses to serve: startup verification failed ({message}). "
            "Set VLLM_LING_VERIFY=warn to serve anyway.")
    for c in failed:
        logger.warning("verification check %s FAILED: expected %s, got %s. Fix: %s",
                       c["name"], c["expected"], c["actual"], c["fix"])
