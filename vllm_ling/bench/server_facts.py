"""What the measured server was: facts recorded in every result so two runs can be told apart.

Sources, each optional (a plain OpenAI server has none of the vllm-ling ones):

- the startup verification report, from ``GET /vllm_ling/report`` or ``--server-report FILE``:
  pass/fail and policy, platform and GPU arch, vLLM / humming versions, each optimization's
  requested/active state, each check (and known-answer kernel check) passed or not, MoE
  backend, head dtype, speculation, the smoke check's accept length, and its ``startup`` /
  ``memory`` sections where the server writes them (the reporting worker's humming JIT
  kernels compiled vs loaded from the cache and compile seconds, or "not applicable" on CPU;
  its weight and allocated KV-cache bytes);
- ``/metrics`` at the start: ``vllm_ling:info`` labels, ``vllm_ling:optimization_active``,
  ``vllm_ling:kernel_check_passed``, vLLM's ``vllm:cache_config_info`` (KV blocks, block size,
  KV capacity in tokens and requests, cache dtypes, memory fraction), the API server's resident
  memory, ``vllm_ling:startup_seconds`` (launch to ready), and the gauges of the report's
  memory / startup facts where exported (``vllm_ling:kv_cache_bytes``, ``vllm_ling:weights_bytes``,
  ``vllm_ling:humming_jit_*``);
- ``/metrics`` sampled during the run: ``vllm:kv_cache_usage_perc`` and the running / waiting
  request counts (:class:`UsageSampler`);
- the harness itself: its vllm-ling version and, when it launched the server (ablation), the
  seconds from launch to a healthy ``/health``.

:func:`diff_facts` lists what differs between two results' facts for ``bench compare``.
"""

from __future__ import annotations

import asyncio
import json
import time
from typing import Any

import aiohttp

from vllm_ling.bench.client import auth_headers
from vllm_ling.bench.json_file import read_json
from vllm_ling.bench.scrape import parse_prometheus
from vllm_ling.bench.stats import summarize

REPORT_ROUTE = "/vllm_ling/report"
KV_USAGE = "vllm:kv_cache_usage_perc"
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
# Gauges a server may export about its start and memory (none in vLLM 0.32 itself; vllm-ling's
# stat logger exports them, runtime/stat_logger.py), and the facts they become.
STARTUP_GAUGES = {
    "vllm_ling:startup_seconds": "launch_to_ready_s",
    "vllm_ling:humming_jit_applicable": "humming_jit_applicable",
    "vllm_ling:humming_jit_compile_seconds": "humming_jit_compile_s",
    "vllm_ling:humming_jit_cache_hits": "humming_jit_cache_hits",
    "vllm_ling:humming_jit_compiled_kernels": "humming_jit_compiled_kernels",
    "vllm_ling:weights_bytes": "weights_bytes",
    "vllm_ling:kv_cache_bytes": "kv_cache_bytes",
}


class FactsError(ValueError):
    pass


def load_report_file(path: str) -> dict[str, Any]:
    data = read_json(path, f"--server-report {path!r}", FactsError)
    if not isinstance(data, dict) or "optimizations" not in data:
        raise FactsError(f"--server-report {path!r}: not a vllm-ling verification report (no 'optimizations')")
    return data


def facts_from_report(report: dict[str, Any]) -> dict[str, Any]:
    """The report's facts, flattened to what a comparison reads."""
    opts = report.get("optimizations") or {}
    out: dict[str, Any] = {
        "passed": report.get("passed"),
        "policy": report.get("policy"),
        "platform": report.get("platform"),
        "gpu_arch": report.get("gpu_arch"),
        "versions": dict(report.get("versions") or {}),
        "optimizations": {k: (v.get("active") if isinstance(v, dict) else bool(v)) for k, v in opts.items()},
        "checks": {c["name"]: c.get("passed") for c in report.get("checks") or [] if isinstance(c, dict)
                   and "name" in c},
        "moe_backend": report.get("moe_backend"),
        "head_dtype": report.get("head_dtype"),
        "spec_method": report.get("spec_method"),
        "num_speculative_tokens": report.get("num_speculative_tokens"),
        "smoke_accept_length": (report.get("smoke") or {}).get("accept_length"),
    }
    kernel_checks = report.get("kernel_checks")
    if isinstance(kernel_checks, list):
        out["kernel_checks"] = {k.get("kernel", k.get("name")): k.get("passed") for k in kernel_checks
                                if isinstance(k, dict)}
    elif isinstance(kernel_checks, dict) and isinstance(kernel_checks.get("results"), list):
        # the verification report's section (runtime/verification/known_answers.report_section)
        out["kernel_checks"] = {f"{r.get('name')}[{r.get('kernel')}]": r.get("passed")
                                for r in kernel_checks["results"] if isinstance(r, dict) and not r.get("skipped")}
    for section in ("startup", "memory"):
        if isinstance(report.get(section), dict):
            out[section] = dict(report[section])
    return out


def facts_from_metrics(text: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, labels, value in parse_prometheus(text):
        if name == "vllm_ling:info":
            out["info"] = {k: v for k, v in labels.items() if k != "model_name"}
        elif name == "vllm_ling:optimization_active" and "optimization" in labels:
            out.setdefault("optimizations_active", {})[labels["optimization"]] = value == 1.0
        elif name == "vllm_ling:kernel_check_passed" and "kernel" in labels:
            out.setdefault("kernel_checks", {})[labels["kernel"]] = value == 1.0
        elif name == "vllm_ling:verification_passed":
            out["verification_passed"] = value == 1.0
        elif name == "vllm:cache_config_info":
            keep = ("num_gpu_blocks", "block_size", "kv_cache_size_tokens", "kv_cache_max_concurrency",
                    "cache_dtype", "mamba_ssm_cache_dtype", "gpu_memory_utilization", "enable_prefix_caching")
            out["cache_config"] = {k: labels[k] for k in keep if k in labels}
        elif name == "process_resident_memory_bytes":
            out["api_server_resident_bytes"] = value
        elif name in STARTUP_GAUGES:
            out[STARTUP_GAUGES[name]] = value
    return out


def usage_sample(text: str) -> dict[str, float]:
    """KV-cache usage (0-1) and request counts, summed over engines (usage: max over engines)."""
    kv: list[float] = []
    running = waiting = 0.0
    for name, _, value in parse_prometheus(text):
        if name == KV_USAGE:
            kv.append(value)
        elif name == RUNNING:
            running += value
        elif name == WAITING:
            waiting += value
    return {"kv_cache_usage": max(kv) if kv else None, "running": running, "waiting": waiting}


async def get_text(session: aiohttp.ClientSession, url: str, api_key: str | None,
                   timeout_s: float = 30.0) -> tuple[int | None, str]:
    try:
        async with session.get(url, headers=auth_headers(api_key),
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.text()
    except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
        return None, f"{exc.__class__.__name__}: {exc}"


class UsageSampler:
    """Samples ``/metrics`` every ``interval_s`` while a run lasts (a background task)."""

    def __init__(self, session: aiohttp.ClientSession, base_url: str, api_key: str | None, interval_s: float):
        self.session, self.base_url, self.api_key, self.interval_s = session, base_url, api_key, interval_s
        self.samples: list[dict[str, float]] = []
        self._task: asyncio.Task | None = None
        self._t0 = 0.0

    async def _loop(self) -> None:
        while True:
            status, text = await get_text(self.session, f"{self.base_url}/metrics", self.api_key, timeout_s=10)
            if status == 200:
                self.samples.append({"t_s": time.perf_counter() - self._t0, **usage_sample(text)})
            await asyncio.sleep(self.interval_s)

    def start(self) -> None:
        self._t0 = time.perf_counter()
        if self.interval_s > 0:
            self._task = asyncio.ensure_future(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            try:
                await self._task
            except asyncio.CancelledError:
                pass

    def summary(self) -> dict[str, Any]:
        kv = [s["kv_cache_usage"] for s in self.samples if s["kv_cache_usage"] is not None]
        return {"interval_s": self.interval_s, "samples": self.samples,
                "kv_cache_usage": summarize(kv) if kv else None,
                "max_running": max((s["running"] for s in self.samples), default=None),
                "max_waiting": max((s["waiting"] for s in self.samples), default=None)}


async def collect_start_facts(session: aiohttp.ClientSession, base_url: str, api_key: str | None,
                              report_file: str | None) -> dict[str, Any]:
    """Report and /metrics facts at the start of a run; each source's absence is recorded."""
    from vllm_ling.versions import installed_version  # noqa: PLC0415

    facts: dict[str, Any] = {"bench_vllm_ling_version": installed_version("vllm-ling"), "sources": {}}
    report = None
    if report_file:
        report = load_report_file(report_file)
        facts["sources"]["report"] = f"file {report_file}"
    else:
        status, text = await get_text(session, f"{base_url}{REPORT_ROUTE}", api_key)
        if status == 200:
            try:
                report = json.loads(text)
                facts["sources"]["report"] = f"GET {REPORT_ROUTE}"
            except json.JSONDecodeError:
                facts["sources"]["report"] = f"GET {REPORT_ROUTE}: not JSON"
        else:
            facts["sources"]["report"] = (f"GET {REPORT_ROUTE}: " + (f"HTTP {status}" if status else text)
                                          + " (no vllm-ling report endpoint; pass --server-report FILE)")
    facts["report"] = facts_from_report(report) if isinstance(report, dict) else None
    status, text = await get_text(session, f"{base_url}/metrics", api_key)
    facts["metrics"] = facts_from_metrics(text) if status == 200 else None
    facts["sources"]["metrics"] = "GET /metrics" if status == 200 else f"GET /metrics: {status or text}"
    return facts


def _flatten(d: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(d, dict):
        return {prefix: d}
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}.{k}" if prefix else str(k)
        if isinstance(v, dict):
            out.update(_flatten(v, key))
        else:
            out[key] = v
    return out


# Facts that differ between any two runs and say nothing about the server's configuration
# (the JIT detail restates the JIT numbers, which are compared).
_VOLATILE = ("sources.", "metrics.api_server_resident_bytes", "run.", "report.startup.humming_jit_detail")


def comparable_facts(facts: dict[str, Any] | None) -> dict[str, Any]:
    """The facts as flat ``section.key`` -> value, without per-run noise (sources, RSS, usage)."""
    flat = _flatten({k: v for k, v in (facts or {}).items() if k != "usage"})
    return {k: v for k, v in flat.items() if not k.startswith(_VOLATILE)}


def diff_facts(a: dict[str, Any] | None, b: dict[str, Any] | None) -> list[dict[str, Any]]:
    """``[{fact, a, b}]`` for every configuration fact that differs (absent on one side included)."""
    fa, fb = comparable_facts(a), comparable_facts(b)
    return [{"fact": k, "a": fa.get(k), "b": fb.get(k)} for k in sorted(set(fa) | set(fb))
            if fa.get(k) != fb.get(k)]
