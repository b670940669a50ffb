"""Run a workload against an OpenAI-compatible server and collect the study's measurements."""

from __future__ import annotations

import asyncio
import dataclasses
import datetime as _dt
import os
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp

from vllm_ling.log import get_logger
from vllm_ling.bench import gsm8k, scrape, workloads
from vllm_ling.bench.client import (
    RequestResult,
    ServerError,
    auth_headers,
    first_model,
    stream_completion,
)
from vllm_ling.bench.stats import summarize

logger = get_logger("bench")

RESULTS_SCHEMA = "vllm-ling-bench/1"


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    workload: str = "synthetic"
    model: str | None = None  # default: the first model of /v1/models
    api_key: str | None = None  # default: $OPENAI_API_KEY
    num_requests: int | None = None  # default: 1 for synthetic, all questions for gsm8k
    concurrency: int = 1
    seed: int = 0
    input_len: int = 32768  # synthetic
    output_len: int = 2048  # synthetic
    token_id_range: tuple[int, int] = (10, 1000)  # synthetic
    max_tokens: int = 32768  # gsm8k
    dataset: str | None = None  # gsm8k jsonl (default: packaged 1,319 test questions)
    fewshot: str | None = None  # gsm8k exemplars jsonl (default: built-in)
    hf_dataset: bool = False  # gsm8k from the Hugging Face hub (needs network)
    request_timeout_s: float = 3600.0
    out_dir: str | None = None  # write results.json, results.md and PNG plots here
    label: str | None = None
    progress: bool = True
    plots: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in results["config"]


class BenchError(ValueError):
    """Bad benchmark input (a flag or file) or an unusable server."""


def build_requests(cfg: BenchConfig) -> list[workloads.BenchRequest]:
    if cfg.workload == "synthetic":
        n = 1 if cfg.num_requests is None else cfg.num_requests
        low, high = cfg.token_id_range
        return workloads.synthetic_requests(num_requests=n, input_len=cfg.input_len,
                                            output_len=cfg.output_len, seed=cfg.seed,
                                            token_id_low=low, token_id_high=high)
    if cfg.workload == "gsm8k":
        return workloads.gsm8k_requests(num_requests=cfg.num_requests, max_tokens=cfg.max_tokens,
                                        seed=cfg.seed, dataset=cfg.dataset, fewshot=cfg.fewshot,
                                        hf_dataset=cfg.hf_dataset)
    raise BenchError(f"unknown workload {cfg.workload!r}; choose one of {', '.join(workloads.WORKLOADS)}")


class _Progress:
    """tqdm when installed, else one self-overwriting stderr line."""

    def __init__(self, total: int, enabled: bool, desc: str):
        self.total, self.done, self.enabled, self.desc = total, 0, enabled, desc
        self._bar = None
        if enabled:
            try:
                from tqdm import tqdm  # noqa: PLC0415

                self._bar = tqdm(total=total, desc=desc, unit="req", file=sys.stderr)
            except ImportError:
                self._bar = None

    def update(self) -> None:
        self.done += 1
        if not self.enabled:
            return
        if self._bar is not None:
            self._bar.update(1)
        else:
            print(f"\r{self.desc}: {self.done}/{self.total} requests", end="", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        elif self.enabled:
            print(file=sys.stderr)


async def _scrape(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> tuple[dict | None, str | None]:
    try:
        async with session.get(f"{base_url}/metrics", headers=auth_headers(api_key),
                               timeout=aiohttp.ClientTimeout(total=30)) as resp:
            if resp.status != 200:
                return None, f"GET {base_url}/metrics: HTTP {resp.status}"
            return scrape.spec_counters(await resp.text()), None
    except aiohttp.ClientError as exc:
        return None, f"GET {base_url}/metrics: {exc}"


async def _run(cfg: BenchConfig, requests: list[workloads.BenchRequest]) -> dict[str, Any]:
    base_url = cfg.base_url.rstrip("/")
    api_key = cfg.api_key if cfg.api_key is not None else os.environ.get("OPENAI_API_KEY")
    connector = aiohttp.TCPConnector(limit=max(cfg.concurrency, 1) + 2)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            model = cfg.model or await first_model(session, base_url, api_key)
        except ServerError as exc:
            raise ServerError(f"cannot use the server at --base-url {base_url}: {exc}") from exc
        before, metrics_error = await _scrape(session, base_url, api_key)
        sem = asyncio.Semaphore(cfg.concurrency)
        progress = _Progress(len(requests), cfg.progress, f"bench {cfg.workload}")
        results: list[RequestResult | None] = [None] * len(requests)

        async def one(i: int, req: workloads.BenchRequest) -> None:
            async with sem:
                results[i] = await stream_completion(session, base_url, model, req, api_key,
                                                     cfg.request_timeout_s)
                progress.update()

        started = time.time()
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        duration = time.perf_counter() - t0
        progress.close()
        after, metrics_error_after = await _scrape(session, base_url, api_key)
    metrics_error = metrics_error or metrics_error_after
    return {"model": model, "results": results, "duration_s": duration, "started": started,
            "spec_before": before, "spec_after": after, "metrics_error": metrics_error}


def summarize_run(cfg: BenchConfig, requests: list[workloads.BenchRequest], run: dict[str, Any]) -> dict[str, Any]:
    results: list[RequestResult] = run["results"]
    warnings: list[str] = []
    rows = []
    for req, res in zip(requests, results):
        row = res.to_dict()
        row["prompt_len"] = len(req.prompt) if isinstance(req.prompt, list) else None
        if req.gold is not None:
            row["question_id"] = req.meta.get("question_id")
            row["gold"] = req.gold
            row.update(gsm8k.score(res.text, req.gold) if res.ok else
                       {"extracted_strict": None, "extracted_flexible": None,
                        "correct_strict": False, "correct_flexible": False})
        rows.append(row)
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    if errors:
        warnings.append(f"{len(errors)} of {len(results)} requests failed; first error: {errors[0].error}")
    if ok and not all(r.usage_reported for r in ok):
        warnings.append("the server sent no usage in the stream for some requests: their output "
                        "token counts are text-chunk counts (TPOT is then approximate)")
    tpot = summarize([r.tpot_s * 1e3 for r in ok if r.tpot_s is not None])
    out_tokens = [r.output_tokens for r in ok]
    summary = {
        "num_requests": len(results),
        "num_ok": len(ok),
        "num_errors": len(errors),
        "duration_s": run["duration_s"],
        "ttft_s": summarize([r.ttft_s for r in ok]),
        "tpot_ms": tpot,
        "itl_ms": summarize([x * 1e3 for r in ok for x in r.itl_s]),
        "e2e_s": summarize([r.e2e_s for r in ok]),
        # The study's "decode tok/s" is 1000 / mean TPOT (per-request decode speed).
        "decode_tokens_per_s": 1e3 / tpot["mean"] if tpot["mean"] else None,
        "output_throughput_tokens_per_s": sum(out_tokens) / run["duration_s"] if run["duration_s"] else None,
        "request_throughput_per_s": len(ok) / run["duration_s"] if run["duration_s"] else None,
        "output_tokens": summarize(out_tokens),
        "total_output_tokens": int(sum(out_tokens)),
    }
    accuracy = None
    if cfg.workload == "gsm8k":
        n = len(rows)
        accuracy = {
            "n": n,
            "strict": sum(r["correct_strict"] for r in rows) / n if n else None,
            "flexible": sum(r["correct_flexible"] for r in rows) / n if n else None,
            "note": "failed requests count as wrong",
        }
    spec = None
    if run["spec_after"] is not None and run["spec_before"] is not None:
        spec = scrape.spec_decode_delta(run["spec_before"], run["spec_after"])
    if run["metrics_error"]:
        warnings.append(f"no speculative-decoding metrics: {run['metrics_error']}")
    for w in warnings:
        logger.warning(w)
    config = dataclasses.asdict(cfg)
    config.pop("api_key", None)  # never write a secret
    config["token_id_range"] = list(cfg.token_id_range)
    return {
        "schema": RESULTS_SCHEMA,
        "label": cfg.label or f"{cfg.workload} @ {cfg.base_url}",
        "started_at": _dt.datetime.fromtimestamp(run["started"], _dt.timezone.utc).isoformat(),
        "server": {"base_url": cfg.base_url, "model": run["model"]},
        "config": config,
        "summary": summary,
        "spec_decode": spec,
        "accuracy": accuracy,
        "warnings": warnings,
        "requests": rows,
    }


def validate(cfg: BenchConfig) -> None:
    if cfg.concurrency < 1:
        raise BenchError(f"--concurrency must be >= 1, got {cfg.concurrency}")
    if cfg.num_requests is not None and cfg.num_requests < 1:
        raise BenchError(f"--num-requests must be >= 1, got {cfg.num_requests}")
    if cfg.max_tokens < 1:
        raise BenchError(f"--max-tokens must be >= 1, got {cfg.max_tokens}")
    if not cfg.base_url.startswith(("http://", "https://")):
        raise BenchError(f"--base-url must start with http:// or https://, got {cfg.base_url!r}")
    if cfg.workload not in workloads.WORKLOADS:
        raise BenchError(f"unknown workload {cfg.workload!r}; choose one of {', '.join(workloads.WORKLOADS)}")


def run_benchmark(config: BenchConfig | None = None, **overrides: Any) -> dict[str, Any]:
    """Run one benchmark and return the results dict (also written to `out_dir` when set).

    Example: ``run_benchmark(base_url="http://127.0.0.1:8000", workload="gsm8k",
    num_requests=8, max_tokens=256, out_dir="out/gsm8k")``. Raises BenchError for bad input
    and ServerError when the server cannot be used.
    """
    cfg = dataclasses.replace(config or BenchConfig(), **overrides)
    validate(cfg)
    try:
        requests = build_requests(cfg)
    except (ValueError, gsm8k.DatasetError) as exc:
        raise BenchError(str(exc)) from exc
    run = asyncio.run(_run(cfg, requests))
    results = summarize_run(cfg, requests, run)
    if cfg.out_dir:
        from vllm_ling.bench import results_files  # noqa: PLC0415

        results["files"] = results_files.write_all(results, cfg.out_dir, plots=cfg.plots)
    return results
