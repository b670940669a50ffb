"""Every rank checks its own modules; the entries are gathered over vLLM's world group (so a rank on
another node is covered too) and merged: the group passes, and an optimization is active, only
where it does on every rank, and every rank read the same vllm-ling settings."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from vllm_ling.options import plugin_options
from vllm_ling.runtime.verification.attention_backends import NOTE_PREFIX, describe, merge_stages
from vllm_ling.runtime.verification.checks import Check


def _node_address() -> str:
    """This rank's node as Ray names it (a Ray worker), else vLLM's host address."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    from vllm.utils.network_utils import get_ip

    return get_ip()


def rank_entry(report: dict[str, Any]) -> dict[str, Any]:
    """This rank's part of the report: where it runs, what it read, what it found."""
    try:
        from vllm.distributed import get_pp_group, get_tensor_model_parallel_rank, get_world_group

        rank, tp_rank, pp_rank = (get_world_group().rank_in_group, get_tensor_model_parallel_rank(),
                                  get_pp_group().rank_in_group)
    except Exception:  # no distributed state (unit tests build models directly)
        rank = tp_rank = pp_rank = 0
    return {"rank": rank, "tp_rank": tp_rank, "pp_rank": pp_rank, "node_ip": _node_address(),
            "pid": os.getpid(), "passed": report["passed"], "head_dtype": report["head_dtype"],
            "optimizations": {n: {"requested": e["requested"], "active": e["active"],
                                  **({"on_stage": False} if e.get("on_stage") is False else {})}
                              for n, e in report["optimizations"].items()},
            "checks": report["checks"],
            "attention_backends": report.get("attention_backends", []),
            # the switches as this process saw them (propagation: vllm_ling/runtime/ray_env.py)
            "options": {o.name: os.environ.get(o.name, "") for o in plugin_options()}}


def gather_ranks(entry: dict[str, Any]) -> list[dict[str, Any]]:
    """Every rank's entry, on every rank, ordered by rank (a collective: all ranks call it)."""
    try:
        from vllm.distributed import get_world_group

        group = get_world_group()
    except Exception:
        return [entry]
    if group.world_size == 1:
        return [entry]
    entries: list[Any] = [None] * group.world_size
    torch.distributed.all_gather_object(entries, entry, group=group.cpu_group)
    return sorted(entries, key=lambda e: e["rank"])


def check_ranks_agree(ranks: list[dict[str, Any]]) -> Check:
    """Every rank read the same vllm-ling settings (each rank checks against its own, so a rank
    with a stale node-local value would otherwise pass its checks while serving differently)."""
    names = sorted({n for r in ranks for n in r["options"]})
    differ = [f"{n}: " + ", ".join(f"rank {r['rank']} ({r['node_ip']}) {r['options'].get(n, '')!r}"
                                  for r in ranks)
              for n in names if len({r["options"].get(n, "") for r in ranks}) > 1]
    return Check("ranks_agree", not differ, "the same vllm-ling settings on every rank",
                 "; ".join(differ) or f"{len(ranks)} rank(s), same settings",
                 "set VLLM_LING_* on the launching process only (vllm-ling serve passes them to "
                 "every Ray worker) and remove stale ones from the other nodes' environment")


def merge_ranks(report: dict[str, Any], ranks: list[dict[str, Any]]) -> Check:
    """The group's verdict in ``report``: passed and active only where true on every rank that holds
    the feature (a pipeline stage without the head says so), and the ranks' settings agree. Returns
    the agreement check."""
    agree = check_ranks_agree(ranks)
    report["ranks"] = ranks
    report["checks"] = report["checks"] + [dataclasses.asdict(agree)]
    report["passed"] = all(r["passed"] for r in ranks) and agree.passed
    # the whole server's layers (a pipeline stage holds only its own), in place of this rank's note
    backends = merge_stages(ranks)
    report["attention_backends"] = backends
    report["notes"] = [n for n in report.get("notes", []) if not n.startswith(NOTE_PREFIX)] + (
        [describe(backends)] if backends else [])
    for name, entry in report["optimizations"].items():
        off = [r for r in ranks if not r["optimizations"].get(name, {}).get("active", False)
               and r["optimizations"].get(name, {}).get("on_stage", True)]
        if entry["active"] and off:
            entry["active"] = False
            entry["detail"] += "; inactive on rank(s) " + ", ".join(
                f"{r['rank']} ({r['node_ip']})" for r in off)
    return agree
