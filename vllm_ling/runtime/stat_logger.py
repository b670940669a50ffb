"""vllm-ling's Prometheus metrics and runtime accept-length guard (a vLLM stat-logger plugin).

vLLM 0.32 loads the entry point ``vllm.stat_logger_plugins: vllm_ling`` in the API-server
(front-end) process and calls :meth:`LingStatLogger.record` with every batch of scheduler
stats. The collectors register in prometheus_client's default registry, which the server's
``/metrics`` serves. They are named ``vllm_ling:*`` because vLLM's own Prometheus logger
unregisters every ``vllm:``-prefixed collector it did not create.

Exported (``model_name`` label on all; ``engine`` on the accept metrics, as vLLM does):

==========================================================  =======================================
``vllm_ling:accept_length{engine}``                          1 + accepted / drafts over the window
``vllm_ling:accept_rate_per_position{engine,position}``      accepted at position / drafts (window);
                                                             the rates sum to accept_length - 1
``vllm_ling:accept_window_drafts{engine}``                   drafts the window holds now
``vllm_ling:accept_break_even``                              the guard's threshold
``vllm_ling:accept_collapse_total{engine}``                  collapse episodes so far
``vllm_ling:accept_collapse_active{engine}``                 1 while an episode lasts
``vllm_ling:optimization_requested{optimization}``           1/0 per key of the report's optimizations
``vllm_ling:optimization_active{optimization}``              1/0 per key of the report's optimizations
``vllm_ling:verification_passed``                            1/0, the startup verification's verdict
                                                             (every rank's)
``vllm_ling:kernel_check_passed{kernel,impl}``               1/0 per known-answer kernel check
                                                             (``kernel``: dense_fp8, moe_mxfp4,
                                                             fp8_head, kda, router_gemv,
                                                             router_topk, kda_conv; ``impl``: what
                                                             serves)
``vllm_ling:rank_verification_passed{rank,node}``            1/0 per rank of the server (its node)
``vllm_ling:attention_backend_layers{model,layer,backend,    attention layers of that class holding
prefill}``                                                    that backend (the report's
                                                             attention_backends: e.g. MLA decode
                                                             FLASH_ATTN_MLA or FLASHMLA)
``vllm_ling:chat_roundtrip{status}``                         1 for the chat template / parser
                                                             round-trip check's status (passed,
                                                             failed, off_by_request)
``vllm_ling:info{vllm_version,humming_version,moe_backend,   value 1; labels from the report
head_dtype,spec_method,gpu_arch,platform,policy}``
``vllm_ling:startup_seconds``                                this API-server process's start to the
                                                             engine ready (weights, profiling, KV
                                                             cache, warm-up, compilation)
``vllm_ling:weights_bytes``                                  weight bytes the reporting worker holds
``vllm_ling:kv_cache_bytes``                                 KV-cache bytes that worker allocated
``vllm_ling:humming_jit_applicable``                         1 where humming can run (CUDA), 0 on CPU
``vllm_ling:humming_jit_compiled_kernels``                   humming kernels that worker compiled up
                                                             to ready (0 on CPU)
``vllm_ling:humming_jit_cache_hits``                         humming kernels it loaded from the cache
``vllm_ling:humming_jit_compile_seconds``                    wall seconds it spent compiling them
==========================================================  =======================================

The accept metrics appear with the first draft; the report metrics once the startup
verification report exists (see :class:`ReportReader`).

The window and the collapse guard are :mod:`vllm_ling.runtime.acceptance`; the report is
:mod:`vllm_ling.runtime.report`.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import psutil
from prometheus_client import REGISTRY, Counter, Gauge
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_ling.log import get_logger, log_once
from vllm_ling.runtime.acceptance import (ENV_ACCEPT_WINDOW, ENV_BREAK_EVEN, AcceptWindow, CollapseGuard,
                                          accept_window_from_env,
                                          break_even_for)
from vllm_ling.runtime.report import ENV_REPORT_PATH, ReportReader

logger = get_logger("metrics")

METRIC_PREFIX = "vllm_ling:"
# How often record() looks at the report file (a stat() call) until the file changes.
REPORT_POLL_SECONDS = 1.0
# (report section, key) -> gauge exported from it; absent keys leave the gauge unset.
REPORT_VALUE_GAUGES = {
    ("memory", "weights_bytes"): ("vllm_ling:weights_bytes",
                                  "Bytes of the weights the reporting worker holds (each storage once)."),
    ("memory", "kv_cache_bytes"): ("vllm_ling:kv_cache_bytes",
                                   "Bytes of the KV cache the reporting worker allocated (each storage once)."),
    ("startup", "humming_jit_applicable"): ("vllm_ling:humming_jit_applicable",
                                            "1 where humming kernels can run (CUDA), 0 where not (CPU)."),
    ("startup", "humming_jit_compiled_kernels"): ("vllm_ling:humming_jit_compiled_kernels",
                                                  "humming JIT kernels the reporting worker compiled up to ready."),
    ("startup", "humming_jit_cache_hits"): ("vllm_ling:humming_jit_cache_hits",
                                            "humming JIT kernels the reporting worker loaded from the cache."),
    ("startup", "humming_jit_compile_s"): ("vllm_ling:humming_jit_compile_seconds",
                                           "Wall seconds the reporting worker spent compiling humming kernels."),
}
INFO_LABELS = ("vllm_version", "humming_version", "moe_backend", "head_dtype", "spec_method",
               "gpu_arch", "platform", "policy")




def unregister_vllm_ling_metrics(registry=REGISTRY) -> None:
    """Drop our collectors from a registry, so a second logger in one process can register."""
    for collector in list(registry._collector_to_names):
        if getattr(collector, "_name", "").startswith(METRIC_PREFIX):
            registry.unregister(collector)


def _label(value: Any) -> str:
    return "none" if value is None else str(value)


class LingStatLogger(AggregateStatLoggerBase):
    """One instance per front end, for all data-parallel engines (labels ``engine``)."""

    def __init__(self, vllm_config, engine_indexes: list[int] | None = None):
        engine_indexes = list(engine_indexes) if engine_indexes else [0]
        self.engine_indexes = engine_indexes
        self.window_size = accept_window_from_env()
        spec = getattr(vllm_config, "speculative_config", None)
        self.num_spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        self.spec_method = getattr(spec, "method", None) if spec else None
        self.break_even = break_even_for(self.spec_method, self.num_spec_tokens)
        model_name = vllm_config.model_config.served_model_name
        if isinstance(model_name, (list, tuple)):
            model_name = model_name[0]
        self.model_name = str(model_name)

        unregister_vllm_ling_metrics()
        engine_labels = ["model_name", "engine"]
        self.g_accept_length = Gauge(
            "vllm_ling:accept_length",
            f"MTP accept length (1 + accepted/drafts, bonus token included) over the last "
            f"{ENV_ACCEPT_WINDOW} drafts.",
            labelnames=engine_labels, multiprocess_mode="mostrecent")
        self.g_accept_per_pos = Gauge(
            "vllm_ling:accept_rate_per_position",
            "Fraction of the window's drafts whose token at this 0-based position was accepted.",
            labelnames=engine_labels + ["position"], multiprocess_mode="mostrecent")
        self.g_window_drafts = Gauge(
            "vllm_ling:accept_window_drafts",
            "Drafts in the accept-length window now (the guard acts once it holds the window).",
            labelnames=engine_labels, multiprocess_mode="mostrecent")
        self.g_break_even = Gauge(
            "vllm_ling:accept_break_even",
            f"Accept length below which MTP costs more than it saves ({ENV_BREAK_EVEN}).",
            labelnames=["model_name"], multiprocess_mode="mostrecent")
        self.g_collapse_active = Gauge(
            "vllm_ling:accept_collapse_active",
            "1 while the windowed accept length is below break-even (a collapse episode).",
            labelnames=engine_labels, multiprocess_mode="mostrecent")
        self.c_collapse = Counter(
            "vllm_ling:accept_collapse",
            "Episodes of the windowed accept length falling below break-even.",
            labelnames=engine_labels)
        self.g_opt_requested = Gauge(
            "vllm_ling:optimization_requested",
            "1 when the optimization was requested (startup verification report).",
            labelnames=["model_name", "optimization"], multiprocess_mode="mostrecent")
        self.g_opt_active = Gauge(
            "vllm_ling:optimization_active",
            "1 when startup verification proved the optimization active.",
            labelnames=["model_name", "optimization"], multiprocess_mode="mostrecent")
        self.g_verification = Gauge(
            "vllm_ling:verification_passed",
            "1 when every startup verification check passed.",
            labelnames=["model_name"], multiprocess_mode="mostrecent")
        self.g_kernel_check = Gauge(
            "vllm_ling:kernel_check_passed",
            "1 when the serving kernel matched its known answers at startup (report's kernel_checks).",
            labelnames=["model_name", "kernel", "impl"], multiprocess_mode="mostrecent")
        self.g_rank_verification = Gauge(
            "vllm_ling:rank_verification_passed",
            "1 when every startup verification check passed on this rank (label node: its host).",
            labelnames=["model_name", "rank", "node"], multiprocess_mode="mostrecent")
        self.g_attention = Gauge(
            "vllm_ling:attention_backend_layers",
            "Attention layers of a class holding a backend, as vLLM chose it (report's attention_backends).",
            labelnames=["model_name", "model", "layer", "backend", "prefill"], multiprocess_mode="mostrecent")
        self.g_roundtrip = Gauge(
            "vllm_ling:chat_roundtrip",
            "Chat template / parser round-trip check at startup: 1 on its status label.",
            labelnames=["model_name", "status"], multiprocess_mode="mostrecent")
        self.g_info = Gauge(
            "vllm_ling:info", "vllm-ling build and configuration (value 1; see the labels).",
            labelnames=["model_name", *INFO_LABELS], multiprocess_mode="mostrecent")
        self.g_startup = Gauge(
            "vllm_ling:startup_seconds",
            "Seconds from the API-server process's start to the engine being ready to serve.",
            labelnames=["model_name"], multiprocess_mode="mostrecent")

        # The report's memory / startup sections (vllm_ling.runtime.startup_facts), one gauge each.
        self.g_report_values = {
            key: Gauge(name, doc, labelnames=["model_name"], multiprocess_mode="mostrecent")
            for key, (name, doc) in REPORT_VALUE_GAUGES.items()}

        self.windows: dict[int, AcceptWindow] = {}
        self.guards: dict[int, CollapseGuard] = {}
        if self.num_spec_tokens > 0:
            self.g_break_even.labels(self.model_name).set(self.break_even)
            for idx in engine_indexes:
                self.windows[idx] = AcceptWindow(self.window_size, self.num_spec_tokens)
                counter = self.c_collapse.labels(self.model_name, str(idx))
                self.guards[idx] = CollapseGuard(self.break_even, idx, on_collapse=counter.inc)
        self.report_reader = ReportReader()
        self._applied_report: dict | None = None
        self._next_report_poll = 0.0

    # -- vLLM's StatLoggerBase interface -----------------------------------------------

    def record(self, scheduler_stats, iteration_stats, mm_cache_stats=None, engine_idx: int = 0):
        # vLLM calls this inside its output handler, where an exception would fail every
        # in-flight request: a metrics bug must cost only the metrics, loudly.
        try:
            spec_stats = getattr(scheduler_stats, "spec_decoding_stats", None)
            if spec_stats is not None and spec_stats.num_drafts > 0:
                self.observe_spec_decoding(spec_stats, engine_idx)
            now = time.monotonic()
            if now >= self._next_report_poll:
                self._next_report_poll = now + REPORT_POLL_SECONDS
                self.refresh_report()
        except Exception as e:  # noqa: BLE001
            if log_once(logger, logging.WARNING, f"record:{type(e).__name__}",
                        "vllm-ling metrics failed to record scheduler stats (%s: %s); the vllm_ling:* "
                        "metrics may be stale, serving continues. Please report this.",
                        type(e).__name__, e):
                logger.debug("vllm-ling metrics failure", exc_info=True)

    def log(self):
        self.refresh_report()

    def log_engine_initialized(self):
        # vLLM calls this once the engine cores are up: weights loaded, KV cache sized, warmed up.
        startup = time.time() - psutil.Process().create_time()
        self.g_startup.labels(self.model_name).set(startup)
        logger.info("vllm-ling: engine ready %.1f s after the API server process started.", startup)
        report = self.refresh_report()
        if self.num_spec_tokens > 0:
            logger.info("vllm-ling accept-length guard: window %d drafts (%s), break-even %.2f (%s).",
                        self.window_size, ENV_ACCEPT_WINDOW, self.break_even, ENV_BREAK_EVEN)
        else:
            logger.info("vllm-ling accept-length guard off: no speculative decoding configured.")
        if report is None:
            logger.info("vllm-ling report not found yet at %s=%s; its metrics appear once it exists.",
                        ENV_REPORT_PATH, self.report_reader.path)

    # -- ours ----------------------------------------------------------------------------

    def observe_spec_decoding(self, spec_stats, engine_idx: int = 0) -> None:
        window = self.windows.get(engine_idx)
        if window is None:
            if self.num_spec_tokens <= 0:
                return
            window = self.windows[engine_idx] = AcceptWindow(self.window_size, self.num_spec_tokens)
            counter = self.c_collapse.labels(self.model_name, str(engine_idx))
            self.guards[engine_idx] = CollapseGuard(self.break_even, engine_idx, on_collapse=counter.inc)
        window.add(spec_stats.num_drafts, spec_stats.num_draft_tokens,
                   spec_stats.num_accepted_tokens, spec_stats.num_accepted_tokens_per_pos)
        engine = str(engine_idx)
        self.g_accept_length.labels(self.model_name, engine).set(window.accept_length)
        self.g_window_drafts.labels(self.model_name, engine).set(window.drafts)
        for pos, rate in enumerate(window.per_position_rates()):
            self.g_accept_per_pos.labels(self.model_name, engine, str(pos)).set(rate)
        guard = self.guards[engine_idx]
        guard.update(window)
        self.g_collapse_active.labels(self.model_name, engine).set(1 if guard.in_episode else 0)

    def refresh_report(self) -> dict | None:
        report = self.report_reader.read()
        if report is not None and report is not self._applied_report:
            self._apply_report(report)
        return report

    def _apply_report(self, report: dict) -> None:
        self._applied_report = report
        self.g_opt_requested.clear()
        self.g_opt_active.clear()
        for name, entry in report["optimizations"].items():
            self.g_opt_requested.labels(self.model_name, name).set(1 if entry["requested"] else 0)
            self.g_opt_active.labels(self.model_name, name).set(1 if entry["active"] else 0)
        self.g_verification.labels(self.model_name).set(1 if report["passed"] else 0)
        self.g_kernel_check.clear()
        for r in (report.get("kernel_checks") or {}).get("results", []):
            if not r.get("skipped"):
                self.g_kernel_check.labels(self.model_name, r["name"], r["kernel"]).set(1 if r["passed"] else 0)
        self.g_rank_verification.clear()
        for rank in report.get("ranks") or []:
            self.g_rank_verification.labels(self.model_name, str(rank.get("rank")),
                                            _label(rank.get("node_ip"))).set(1 if rank.get("passed") else 0)
        self.g_attention.clear()
        for e in report.get("attention_backends") or []:
            self.g_attention.labels(self.model_name, _label(e.get("model")), _label(e.get("layer")),
                                    _label(e.get("backend")), _label(e.get("prefill"))).set(e.get("layers", 0))
        self.g_roundtrip.clear()
        roundtrip = report.get("chat_roundtrip")
        if isinstance(roundtrip, dict) and isinstance(roundtrip.get("status"), str):
            self.g_roundtrip.labels(self.model_name, roundtrip["status"].replace(" ", "_")).set(1)
        versions = report.get("versions")
        versions = versions if isinstance(versions, dict) else {}
        self.g_info.clear()
        self.g_info.labels(
            self.model_name,
            _label(versions.get("vllm")), _label(versions.get("humming")),
            _label(report.get("moe_backend")), _label(report.get("head_dtype")),
            _label(report.get("spec_method")), _label(report.get("gpu_arch")),
            _label(report.get("platform")), _label(report.get("policy")),
        ).set(1)
        for (section, key), gauge in self.g_report_values.items():
            value = (report.get(section) or {}).get(key)
            if isinstance(value, (bool, int, float)):
                gauge.labels(self.model_name).set(float(value))
        inactive = [n for n, e in report["optimizations"].items() if e["requested"] and not e["active"]]
        logger.info("vllm-ling report %s loaded: verification %s (policy %s)%s.",
                    self.report_reader.path, "passed" if report["passed"] else "FAILED",
                    report.get("policy"),
                    f"; requested but inactive: {', '.join(inactive)}" if inactive else "")
