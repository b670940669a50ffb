"""Startup facts a worker knows only after vLLM allocated the KV cache and warmed up: the KV
cache's bytes, this process's humming JIT compiles and cache hits, the split bound its
FlashAttention metadata builders hold (the ``decode_splits`` entry is confirmed against it) and how often
the model called the residual norm kernel (the ``residual_norm`` entry is confirmed by it).

vLLM 0.32 holds the allocated KV cache only in the worker: its model runner's ``kv_caches``
are views of the raw tensors sized by the engine's ``KVCacheConfig``. The front end learns
only ``num_gpu_blocks`` and the capacity in tokens (``EngineCoreReadyResponse``; the server
logs the bytes, no metric carries them), and vLLM calls no plugin in the worker after its
warm-up, so patch P8 calls :func:`record_after_warmup` there, before the engine reports ready.
Compiles that warm-up and CUDA-graph capture trigger are therefore included. The worker that
writes the verification report (:func:`~vllm_ling.runtime.report.is_reporting_rank`)
merges its own numbers into it: ``startup`` (humming JIT, flat keys) and
``memory.kv_cache_bytes``; the stat logger exports them as gauges.
"""

from __future__ import annotations

from typing import Any

from vllm_ling.log import get_logger
from vllm_ling.ops import humming_jit
from vllm_ling.options import LingOptions
from vllm_ling.runtime.decode_splits import bound_in_force, builder_bounds
from vllm_ling.runtime.report import is_reporting_rank, update_report
from vllm_ling.runtime.residual_norm import sum_fold_state
from vllm_ling.runtime.storage import distinct_storage_bytes
from vllm_ling.runtime.verification.decode_splits import confirm_builders
from vllm_ling.runtime.verification.residual_norm import confirm_calls, moe_sum_fold_entry

logger = get_logger("startup")

CPU_REASON = "CPU platform: humming kernels run on CUDA GPUs only; nothing was compiled or loaded"


def kv_cache_bytes(model_runner) -> int:
    """Bytes of the KV cache a model runner has bound: every layer's cache is a view of a raw
    allocation, and layers of different groups share one (hybrid models), so storages count once."""
    return distinct_storage_bytes(t for t in getattr(model_runner, "kv_caches", []) if t is not None)


def _world_rank() -> int:
    try:
        from vllm.distributed import get_world_group

        return get_world_group().rank_in_group
    except Exception:  # noqa: BLE001 - no distributed state (unit tests)
        return 0


def startup_section(applicable: bool) -> dict[str, Any]:
    facts = humming_jit.jit_facts(applicable, "" if applicable else CPU_REASON)
    facts["rank"] = _world_rank()
    return facts


def record_after_warmup(worker) -> dict[str, Any]:
    """Measure, log one INFO line, and merge into the report where this worker writes it."""
    from vllm.platforms import current_platform

    startup = startup_section(applicable=current_platform.is_cuda())
    kv_bytes = kv_cache_bytes(worker.model_runner)
    jit = ("humming JIT: " + startup["humming_jit_detail"]) if startup["humming_jit_applicable"] \
        else "humming JIT not applicable (CPU)"
    logger.info("vllm-ling startup facts (rank %d): KV cache %d bytes (%.1f MiB); %s.",
                startup["rank"], kv_bytes, kv_bytes / 2**20, jit)

    builders = builder_bounds(worker.model_runner)
    startup["decode_split_bounds"] = builders
    from vllm_ling.layers.residual_norm import calls as residual_norm_calls, folded_calls

    norm_calls = startup["residual_norm_calls"] = residual_norm_calls()
    folded = startup["residual_norm_folded_calls"] = folded_calls()

    def merge(report: dict[str, Any]) -> None:
        report["startup"] = startup
        report.setdefault("memory", {})["kv_cache_bytes"] = kv_bytes
        splits = report.get("optimizations", {}).get("decode_splits")
        if splits is not None:
            report["optimizations"]["decode_splits"] = confirm_builders(
                splits, builders, bound_in_force(worker.vllm_config))
        norm = report.get("optimizations", {}).get("residual_norm")
        if norm is not None:
            norm = report["optimizations"]["residual_norm"] = confirm_calls(norm, norm_calls)
            report["optimizations"]["moe_sum_fold"] = moe_sum_fold_entry(
                norm, folded, *sum_fold_state(worker.vllm_config.compilation_config))

    path = LingOptions.current().report_path
    if is_reporting_rank() and path and not update_report(path, merge):
        logger.info("vllm-ling startup facts are in the log only: no verification report at %s "
                    "(VLLM_LING_VERIFY=off?).", path)
    return {"startup": startup, "kv_cache_bytes": kv_bytes}
