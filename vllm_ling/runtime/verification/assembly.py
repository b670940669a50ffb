"""Report assembly: one census of the loaded models, every family's check on it, the
optimizations and the facts the report states (what serves, the memory the weights take)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from vllm_ling.options import LingOptions
from vllm_ling.runtime.storage import distinct_storage_bytes
from vllm_ling.runtime.verification import known_answers, vllm_agreement
from vllm_ling.runtime.verification.attention_backends import attention_backends, describe
from vllm_ling.runtime.verification.census import take_census
from vllm_ling.runtime.verification.checks import guarded
from vllm_ling.runtime.verification.decode_splits import CHECK_NAME as DECODE_SPLITS
from vllm_ling.runtime.verification.decode_splits import check_decode_splits, decode_splits_entry
from vllm_ling.runtime.verification.draft_sharing import CHECK_NAME as SHARING
from vllm_ling.runtime.verification.draft_sharing import check_draft_sharing
from vllm_ling.runtime.verification.model_classes import check_model_classes
from vllm_ling.runtime.verification.optimizations import entry, moe_backend, moe_decode_entry
from vllm_ling.runtime.verification.prefill_graphs import CHECK_NAME as PREFILL_GRAPHS
from vllm_ling.runtime.verification.prefill_graphs import check_prefill_graphs, prefill_graphs_entry
from vllm_ling.runtime.verification.recorded import check_recorded
from vllm_ling.runtime.verification.residual_norm import CHECK_NAME as RESIDUAL_NORM
from vllm_ling.runtime.verification.residual_norm import check_residual_norm, residual_norm_entry
from vllm_ling.runtime.verification.speculative import CHECK_NAME as SPECULATIVE
from vllm_ling.runtime.verification.speculative import Speculative, check_speculative, mtp_entry
from vllm_ling.runtime.verification.stage import has_head, pipeline_stage
from vllm_ling.runtime.verification.versions import check_versions, gpu_arch
from vllm_ling.selection import Reader, serving_platform
from vllm_ling.versions import humming_version, vllm_version


def weights_bytes(*modules: torch.nn.Module | None) -> int:
    """Bytes of the parameters and buffers of the given modules in this worker, each storage
    once (the draft shares the target's head and embedding)."""
    return distinct_storage_bytes(t for m in modules if m is not None for t in [*m.parameters(), *m.buffers()])


def serving_notes(vllm_config, known: dict[str, Any]) -> list[str]:
    """What computes, as read from the loaded layers' methods and kernels (not the platform)."""
    served = [f"{r['name']}: {r['kernel']}" for r in known["results"]]
    dense = known["dense_fp8"]
    if dense["kernels"]:
        served.append("dense block-FP8 linears: " + ", ".join(
            f"{n} x {k}" for k, n in sorted(dense["kernels"].items())))
    notes = ["serving kernels: " + "; ".join(served)] if served else []
    if dense["path_choice"]:
        notes.append("dense block-FP8 path: " + dense["path_choice"]["reason"])
    if not vllm_config.cache_config.enable_prefix_caching:
        notes.append("prefix caching is off")
    return notes


def build_report(target, draft, vllm_config, options: LingOptions, spec: Speculative | None = None,
                 platform: str | None = None, readers: tuple[Reader, ...] | None = None) -> dict[str, Any]:
    """This rank's report. ``spec``, ``platform`` and ``readers`` default to what is in force."""
    if readers is None:
        from vllm_ling.layers.readers import readers as layer_readers

        readers = layer_readers()
    spec = spec or Speculative.in_force(vllm_config)
    platform = platform or serving_platform().value
    config = vllm_config.model_config.hf_config
    stage = pipeline_stage(target, config.num_hidden_layers)
    census = take_census(target, draft, readers)
    known = known_answers.report_section(census)
    nextn_here = draft is not None and not spec.dspark  # the NEXTN draft's layers are in the census
    rows = check_recorded(census, readers, config, stage, nextn_here)
    for extra in vllm_agreement.findings(census):
        rows[extra.name] = rows[extra.name].and_(extra)
    sharing = guarded(SHARING, lambda: check_draft_sharing(target, draft, spec, stage))
    checks = [guarded("model_classes", lambda: check_model_classes(target, draft, spec, stage)), *rows.values(),
              sharing, guarded(SPECULATIVE, lambda: check_speculative(spec, options)),
              guarded(PREFILL_GRAPHS, lambda: check_prefill_graphs(vllm_config)),
              guarded(DECODE_SPLITS, lambda: check_decode_splits(vllm_config)),
              guarded(RESIDUAL_NORM, lambda: check_residual_norm(vllm_config)),
              guarded("versions", lambda: check_versions(platform)), known_answers.check(known)]
    by_name = {c.name: c for c in checks}
    optimizations = {r.optimization: entry(r, census, rows[r.check], known, r.expected(config, stage, nextn_here)
                                           if r.expected is not None else None, tuple(by_name[n] for n in r.needs_rows))
                     for r in readers if r.optimization}
    optimizations["moe_decode_kernels"] = moe_decode_entry(census)
    optimizations["mtp"] = mtp_entry(spec, sharing)
    optimizations["prefill_graphs"] = prefill_graphs_entry(vllm_config, by_name[PREFILL_GRAPHS])
    optimizations["decode_splits"] = decode_splits_entry(vllm_config, by_name[DECODE_SPLITS])
    optimizations["residual_norm"] = residual_norm_entry(vllm_config, by_name[RESIDUAL_NORM])
    backends = attention_backends(target, draft)
    return {
        "passed": all(c.passed for c in checks),
        "policy": options.verify,
        "platform": platform,
        "gpu_arch": gpu_arch(),
        "versions": {"vllm": vllm_version() or "unknown", "humming": humming_version()},
        "optimizations": optimizations,
        "moe_backend": moe_backend(census),
        "head_dtype": (str(target.lm_head.weight.dtype).replace("torch.", "") if has_head(target)
                       else f"none ({stage.label()})"),
        "spec_method": spec.method,
        "num_speculative_tokens": spec.num_speculative_tokens,
        "checks": [dataclasses.asdict(c) for c in checks],
        "smoke": {"accept_length": None, "threshold": 0.0, "passed": None},
        "kernel_checks": known,
        "attention_backends": backends,
        "notes": serving_notes(vllm_config, known) + ([describe(backends)] if backends else []),
        "memory": {"weights_bytes": weights_bytes(target, draft)},
    }
