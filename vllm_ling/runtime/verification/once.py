"""``verify_once``: the verification of this process, run the first time a model runner asks (patch
P6) or the target's first forward does: build this rank's report, gather every rank's, write the
group's report on the reporting rank, and apply the policy."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from vllm_ling.log import get_logger, log_once
from vllm_ling.options import LingOptions, VerifyPolicy
from vllm_ling.runtime.report import is_report_source, is_reporting_rank, write_report
from vllm_ling.runtime.verification.assembly import build_report
from vllm_ling.runtime.verification.formatting import format_ranks, format_table
from vllm_ling.runtime.verification.negative_control import apply_negative_control
from vllm_ling.runtime.verification.policy import enforce_policy
from vllm_ling.runtime.verification.ranks import gather_ranks, merge_ranks, rank_entry

logger = get_logger("verify")

_done = False


def verify_once(target, vllm_config, runner: str | None = None) -> dict[str, Any] | None:
    """Run the verification the first time it is called in this process."""
    global _done
    if _done:
        return None
    _done = True
    from vllm_ling.models import loaded

    options = LingOptions.current()
    draft = loaded.get("draft") if vllm_config.speculative_config is not None else None
    apply_negative_control(target, draft)
    if options.verify is VerifyPolicy.OFF:
        log_once(logger, logging.WARNING, "verify-off",
                 "Startup verification is OFF (VLLM_LING_VERIFY=off): optimizations are not checked.")
        return None
    own = build_report(target, draft, vllm_config, options)
    own["model_runner"] = runner or "first forward (no runner hook)"
    entry = rank_entry(own)
    if is_report_source():  # the last stage's report travels to the writer (world rank 0)
        entry["report"] = own
    ranks = gather_ranks(entry)
    sources = [r.pop("report") for r in ranks if "report" in r]
    source = sources[0] if sources else own
    report = dict(source, optimizations={n: dict(e) for n, e in source["optimizations"].items()})
    agree = merge_ranks(report, ranks)
    if is_reporting_rank():
        logger.info("%s\n%s", format_table(report), format_ranks(report["ranks"]))
        if options.report_path:
            write_report(report, options.report_path)
    # each rank refuses for its own failed checks and for settings that differ between ranks
    enforce_policy(dict(own, checks=own["checks"] + [dataclasses.asdict(agree)],
                        passed=own["passed"] and agree.passed), options.verify)
    return report
