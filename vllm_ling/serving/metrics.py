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
``vllm_ling:info{vllm_version,humming_version,moe_backend,   value 1; labels from the report
head_dtype,spec_method,gpu_arch,platform,policy}``
==========================================================  =======================================

The accept metrics appear with the first draft; the report metrics once the startup
verification report exists (see :class:`ReportReader`).

Window: the most recent scheduler steps that together hold at least
``VLLM_LING_ACCEPT_WINDOW`` drafts (default 256); a step's drafts are never split, so the
window exceeds N by less than one step's drafts.

Guard: once the window is full, an accept length below ``VLLM_LING_ACCEPT_BREAK_EVEN``
(default 2.26: the study's MTP verify step costs 2.26 normal decode steps at batch 1, so
speculation pays off only above that accept length) starts a *collapse episode*: one
WARNING with the counts and one increment of ``accept_collapse_total``. The episode ends
(one INFO line) when the windowed accept length is back at or above the threshold.
"""

from __future__ import annotations

import json
import logging
import math
import os
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from prometheus_client import REGISTRY, Counter, Gauge
from vllm.v1.metrics.loggers import AggregateStatLoggerBase

from vllm_ling.log import get_logger, log_once

logger = get_logger("metrics")

ENV_REPORT_PATH = "VLLM_LING_REPORT_PATH"
ENV_ACCEPT_WINDOW = "VLLM_LING_ACCEPT_WINDOW"
ENV_BREAK_EVEN = "VLLM_LING_ACCEPT_BREAK_EVEN"
DEFAULT_ACCEPT_WINDOW = 256
# The study's verify cost at batch 1 in units of one normal decode step (docs/BRIEF.md).
DEFAULT_BREAK_EVEN = 2.26
METRIC_PREFIX = "vllm_ling:"
# How often record() looks at the report file (a stat() call) until the file changes.
REPORT_POLL_SECONDS = 1.0

# The report the startup verification writes (one JSON object). The stat logger and the
# GET /vllm_ling/report endpoint read it; tests validate samples and real reports with it.
_OPTIMIZATION_SCHEMA = {
    "type": "object",
    "required": ["requested", "active", "detail"],
    "properties": {
        "requested": {"type": "boolean"},
        "active": {"type": "boolean"},
        "detail": {"type": "string"},
    },
}
REPORT_JSON_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "type": "object",
    "required": ["passed", "policy", "platform", "gpu_arch", "versions", "optimizations",
                 "moe_backend", "head_dtype", "spec_method", "num_speculative_tokens",
                 "checks", "smoke"],
    "properties": {
        "passed": {"type": "boolean"},
        "policy": {"enum": ["strict", "warn", "off"]},
        "platform": {"enum": ["cpu", "cuda"]},
        "gpu_arch": {"type": ["string", "null"]},
        "versions": {
            "type": "object",
            "required": ["vllm", "humming"],
            "properties": {"vllm": {"type": "string"}, "humming": {"type": ["string", "null"]}},
        },
        "optimizations": {
            "type": "object",
            "required": ["moe_humming", "fp8_head", "mtp"],
            "additionalProperties": _OPTIMIZATION_SCHEMA,
        },
        "moe_backend": {"enum": ["humming", "reference", "vllm"]},
        "head_dtype": {"enum": ["float8_e4m3fn", "bfloat16", "float32"]},
        "spec_method": {"type": ["string", "null"]},
        "num_speculative_tokens": {"type": "integer", "minimum": 0},
        "checks": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "passed", "expected", "actual", "fix"],
                "properties": {
                    "name": {"type": "string"},
                    "passed": {"type": "boolean"},
                    "expected": {"type": "string"},
                    "actual": {"type": "string"},
                    "fix": {"type": "string"},
                },
            },
        },
        "smoke": {
            "type": "object",
            "required": ["accept_length", "threshold", "passed"],
            "properties": {
                "accept_length": {"type": ["number", "null"]},
                "threshold": {"type": "number"},
                "passed": {"type": ["boolean", "null"]},
            },
        },
    },
}
INFO_LABELS = ("vllm_version", "humming_version", "moe_backend", "head_dtype", "spec_method",
               "gpu_arch", "platform", "policy")


def accept_window_from_env() -> int:
    raw = os.environ.get(ENV_ACCEPT_WINDOW)
    if raw is None or raw.strip() == "":
        return DEFAULT_ACCEPT_WINDOW
    try:
        value = int(raw)
    except ValueError:
        value = 0
    if value < 1:
        raise ValueError(f"{ENV_ACCEPT_WINDOW}={raw!r} is not a positive whole number of drafts; "
                         f"unset it for the default {DEFAULT_ACCEPT_WINDOW}.")
    return value


def break_even_from_env() -> float:
    raw = os.environ.get(ENV_BREAK_EVEN)
    if raw is None or raw.strip() == "":
        return DEFAULT_BREAK_EVEN
    try:
        value = float(raw)
    except ValueError:
        value = float("nan")
    if not (value > 0 and math.isfinite(value)):
        raise ValueError(f"{ENV_BREAK_EVEN}={raw!r} is not a positive accept length; unset it "
                         f"for the default {DEFAULT_BREAK_EVEN} (MTP verify cost in decode steps).")
    return value


# --------------------------------------------------------------------------------------
# Accept-length window and collapse guard (plain Python; unit-tested without a server)
# --------------------------------------------------------------------------------------


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


# --------------------------------------------------------------------------------------
# Verification report
# --------------------------------------------------------------------------------------


def _server_start_time() -> float:
    """Start time of this vLLM server: the oldest of this process and its vLLM ancestors.

    A report file older than that belongs to an earlier run (a fixed VLLM_LING_REPORT_PATH
    on a volume) and must not be shown as this server's state.
    """
    try:
        import psutil
    except ImportError:  # psutil comes with vLLM; without it, trust any report
        return 0.0
    try:
        proc = psutil.Process()
        start = proc.create_time()
        for _ in range(4):
            proc = proc.parent()
            if proc is None or "vllm" not in " ".join(proc.cmdline()).lower():
                break
            start = min(start, proc.create_time())
        return start
    except (psutil.Error, OSError):
        return 0.0


def report_problems(report: Any) -> list[str]:
    """What the metrics need from a report and it lacks (an empty list when usable)."""
    if not isinstance(report, dict):
        return [f"top level is {type(report).__name__}, not an object"]
    problems = []
    if not isinstance(report.get("passed"), bool):
        problems.append('"passed" is not true/false')
    optimizations = report.get("optimizations")
    if not isinstance(optimizations, dict):
        problems.append('"optimizations" is not an object')
    else:
        for name, entry in optimizations.items():
            if not (isinstance(entry, dict) and isinstance(entry.get("active"), bool)
                    and isinstance(entry.get("requested"), bool)):
                problems.append(f'"optimizations.{name}" lacks true/false "requested" and "active"')
    return problems


class ReportReader:
    """Reads the verification report lazily: it may appear after the reader is created.

    ``read()`` returns the newest valid report, or None while there is none. It re-parses
    only when the file's mtime or size changed, ignores a file older than the server's
    start (a previous run's), and keeps the last good report while a new one is half
    written. Problems are logged once per file version at WARNING.
    """

    def __init__(self, path: str | None = None, not_before: float | None = None):
        self._fixed_path = path
        self.not_before = _server_start_time() if not_before is None else not_before
        self._seen: tuple[str, float, int] | None = None
        self._report: dict | None = None
        self._warned: set[tuple] = set()
        self._lock = threading.Lock()

    @property
    def path(self) -> str | None:
        return self._fixed_path or os.environ.get(ENV_REPORT_PATH) or None

    def _warn_once(self, key: tuple, msg: str, *args) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning(msg, *args)

    def read(self) -> dict | None:
        path = self.path
        if path is None:
            return None
        try:
            st = os.stat(path)
        except FileNotFoundError:
            return self._report
        except OSError as e:
            self._warn_once(("stat", path, str(e)), "cannot read the vllm-ling report %s (%s): %s",
                            path, ENV_REPORT_PATH, e)
            return self._report
        version = (path, st.st_mtime, st.st_size)
        with self._lock:
            if version == self._seen:
                return self._report
            if st.st_mtime < self.not_before:
                self._warn_once(("stale",) + version,
                                "ignoring the vllm-ling report %s: it was written before this server "
                                "started (a previous run's); waiting for this run's report.", path)
                return self._report
            try:
                with open(path, encoding="utf-8") as f:
                    report = json.load(f)
            except (OSError, ValueError) as e:
                # Possibly caught mid-write: keep the last good one and retry on the next change.
                self._warn_once(("parse",) + version, "cannot parse the vllm-ling report %s: %s",
                                path, e)
                return self._report
            problems = report_problems(report)
            self._seen = version
            if problems:
                self._warn_once(("schema",) + version,
                                "the vllm-ling report %s is not usable (%s); its metrics stay unset.",
                                path, "; ".join(problems))
                return self._report
            self._report = report
            return report


# --------------------------------------------------------------------------------------
# The stat logger
# --------------------------------------------------------------------------------------


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
        self.break_even = break_even_from_env()
        spec = getattr(vllm_config, "speculative_config", None)
        self.num_spec_tokens = int(getattr(spec, "num_speculative_tokens", 0) or 0) if spec else 0
        self.spec_method = getattr(spec, "method", None) if spec else None
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
        self.g_info = Gauge(
            "vllm_ling:info", "vllm-ling build and configuration (value 1; see the labels).",
            labelnames=["model_name", *INFO_LABELS], multiprocess_mode="mostrecent")

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
        inactive = [n for n, e in report["optimizations"].items() if e["requested"] and not e["active"]]
        logger.info("vllm-ling report %s loaded: verification %s (policy %s)%s.",
                    self.report_reader.path, "passed" if report["passed"] else "FAILED",
                    report.get("policy"),
                    f"; requested but inactive: {', '.join(inactive)}" if inactive else "")
