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
from vllm_ling.bench import (arrivals, gsm8k, lengths, replay, scoring, scrape, server_facts,
                                     workloads)
from vllm_ling.bench.client import (
    RequestResult,
    ServerError,
    auth_headers,
    first_model,
    stream_completion,
)
from vllm_ling.bench.stats import summarize

logger = get_logger("bench")

RESULTS_SCHEMA = "vllm-ling-bench/2"
# Older results files `bench compare` still reads (/1 lacks server facts, lengths and replay scores).
READABLE_SCHEMAS = ("vllm-ling-bench/1", RESULTS_SCHEMA)


@dataclass
class BenchConfig:
    base_url: str = "http://127.0.0.1:8000"
    workload: str = "synthetic"
    model: str | None = None  # default: the first model of /v1/models
    api_key: str | None = None  # default: $OPENAI_API_KEY
    num_requests: int | None = None  # default: 1 synthetic, all questions (gsm8k) or lines (replay)
    concurrency: int | None = None  # requests in flight; default 1, unbounded with a request rate
    request_rate: float | None = None  # Poisson arrivals per second; None: send as slots free up
    seed: int = 0
    input_len: int = 32768  # synthetic
    output_len: int = 2048  # synthetic
    input_len_dist: str | None = None  # synthetic: a length list or file (lengths.py)
    output_len_dist: str | None = None  # synthetic
    requests_file: str | None = None  # replay JSONL (replay.py)
    shuffle: bool = False  # replay: seeded shuffle instead of file order
    token_id_range: tuple[int, int] = (10, 1000)  # synthetic
    max_tokens: int = 32768  # gsm8k
    dataset: str | None = None  # gsm8k jsonl (default: packaged 1,319 test questions)
    fewshot: str | None = None  # gsm8k exemplars jsonl (default: built-in)
    hf_dataset: bool = False  # gsm8k from the Hugging Face hub (needs network)
    request_timeout_s: float = 3600.0
    server_report: str | None = None  # verification report file when the server has no endpoint
    metrics_interval_s: float = 1.0  # KV-cache usage sampling period (0: off)
    launch_to_ready_s: float | None = None  # set by whoever launched the server (ablation)
    out_dir: str | None = None  # write results.json, results.md and PNG plots here
    label: str | None = None
    progress: bool = True
    plots: bool = True
    extra: dict[str, Any] = field(default_factory=dict)  # recorded in results["config"]


class BenchError(ValueError):
    """Bad benchmark input (a flag or file) or an unusable server."""


def concurrency_of(cfg: BenchConfig) -> int | None:
    """Requests in flight at most (None: unbounded, only with a request rate)."""
    if cfg.concurrency is not None:
        return cfg.concurrency
    return None if cfg.request_rate is not None else 1


def length_distributions(cfg: BenchConfig) -> tuple[lengths.LengthDistribution | None, lengths.LengthDistribution | None]:
    ind = lengths.parse_length_spec(cfg.input_len_dist, "input", "--input-len-dist") if cfg.input_len_dist else None
    outd = lengths.parse_length_spec(cfg.output_len_dist, "output", "--output-len-dist") if cfg.output_len_dist else None
    return ind, outd


def build_requests(cfg: BenchConfig) -> list[workloads.BenchRequest]:
    if cfg.workload == "synthetic":
        n = 1 if cfg.num_requests is None else cfg.num_requests
        low, high = cfg.token_id_range
        ins, outs = lengths.draw(*length_distributions(cfg), n, cfg.seed)
        return workloads.synthetic_requests(num_requests=n, input_len=cfg.input_len,
                                            output_len=cfg.output_len, seed=cfg.seed,
                                            token_id_low=low, token_id_high=high,
                                            input_lens=ins, output_lens=outs)
    if cfg.workload == "replay":
        if not cfg.requests_file:
            raise BenchError("--workload replay needs --requests FILE.jsonl (one OpenAI chat request per line)")
        return replay.replay_requests(cfg.requests_file, num_requests=cfg.num_requests,
                                      shuffle=cfg.shuffle, seed=cfg.seed)
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
    limit = concurrency_of(cfg)
    connector = aiohttp.TCPConnector(limit=(limit or len(requests) or 1) + 4)
    async with aiohttp.ClientSession(connector=connector) as session:
        try:
            model = cfg.model or await first_model(session, base_url, api_key)
        except ServerError as exc:
            raise ServerError(f"cannot use the server at --base-url {base_url}: {exc}") from exc
        facts = await server_facts.collect_start_facts(session, base_url, api_key, cfg.server_report)
        before, metrics_error = await _scrape(session, base_url, api_key)
        sem = asyncio.Semaphore(limit) if limit else None
        progress = _Progress(len(requests), cfg.progress, f"bench {cfg.workload}")
        results: list[RequestResult | None] = [None] * len(requests)
        offsets = arrivals.arrival_offsets(len(requests), cfg.request_rate, cfg.seed)
        # One request at a time: the /metrics delta around each one is that request's accept length.
        per_request_spec = limit == 1 and before is not None and before.get("found")
        last = {"counters": before}
        sampler = server_facts.UsageSampler(session, base_url, api_key, cfg.metrics_interval_s)

        async def send(i: int, req: workloads.BenchRequest) -> None:
            sent = time.perf_counter() - t0
            res = await stream_completion(session, base_url, model, req, api_key, cfg.request_timeout_s)
            res.send_offset_s = sent
            if per_request_spec:
                after_one, _ = await _scrape(session, base_url, api_key)
                if after_one is not None:
                    delta = scrape.spec_decode_delta(last["counters"], after_one)
                    res.accept_length = delta["accept_length"] if delta else None
                    last["counters"] = after_one
            results[i] = res
            progress.update()

        async def one(i: int, req: workloads.BenchRequest) -> None:
            delay = offsets[i] - (time.perf_counter() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            if sem is None:
                await send(i, req)
            else:
                async with sem:
                    await send(i, req)

        started = time.time()
        t0 = time.perf_counter()
        sampler.start()
        try:
            await asyncio.gather(*(one(i, r) for i, r in enumerate(requests)))
        finally:
            await sampler.stop()
        duration = time.perf_counter() - t0
        progress.close()
        after, metrics_error_after = await _scrape(session, base_url, api_key)
    metrics_error = metrics_error or metrics_error_after
    facts["usage"] = sampler.summary()
    facts["launch_to_ready_s"] = cfg.launch_to_ready_s
    return {"model": model, "results": results, "duration_s": duration, "started": started,
            "spec_before": before, "spec_after": after, "metrics_error": metrics_error, "facts": facts}


def _replay_scores(req: workloads.BenchRequest, res: RequestResult) -> dict[str, Any]:
    """Per-request replay fields: the score when there is an `expected`, tool-call outcome."""
    row: dict[str, Any] = {"replay_id": req.meta["replay_id"], "has_tools": req.meta["has_tools"],
                           "expected": req.meta["expected"], "correct": None, "extracted": None,
                           "tool_called": None, "tool_arguments_errors": [
                               err for _, err in map(scoring.parse_tool_arguments,
                                                     (c["arguments"] for c in res.tool_calls)) if err]}
    if req.meta["has_tools"]:
        row["tool_called"] = bool(res.ok and res.tool_calls)
    if req.expected is not None:
        if res.ok:
            row.update(scoring.score(req.expected, res.text, res.tool_calls))
        else:
            row["correct"] = False
        row["expected_kind"] = req.expected.kind
    return row


def _fraction(flags: list[bool]) -> float | None:
    return sum(flags) / len(flags) if flags else None


def replay_accuracy(rows: list[dict[str, Any]]) -> dict[str, Any]:
    scored = [r for r in rows if r.get("correct") is not None]
    by_kind: dict[str, list[bool]] = {}
    for r in scored:
        by_kind.setdefault(r["expected_kind"], []).append(bool(r["correct"]))
    tool_rows = [r for r in rows if r.get("has_tools")]
    tool_expected = [r for r in scored if r["expected_kind"] == "tool_call"]
    return {
        "n": len(scored),
        "correct": _fraction([bool(r["correct"]) for r in scored]),
        "by_kind": {k: {"n": len(v), "correct": _fraction(v)} for k, v in sorted(by_kind.items())},
        "tool_requests": len(tool_rows),
        "tool_call_fraction": _fraction([bool(r["tool_called"]) for r in tool_rows]),
        "tool_expected": len(tool_expected),
        "tool_match_fraction": _fraction([bool(r["correct"]) for r in tool_expected]),
        "note": "failed requests count as wrong",
    }


# Which per-request booleans `bench compare` tests with McNemar, per workload: {name: row field}.
SCORED_FIELDS = {
    "gsm8k": {"strict": "correct_strict", "flexible": "correct_flexible"},
    "replay": {"expected": "correct", "tool call returned": "tool_called"},
}


def _lengths_sent(cfg: BenchConfig, requests: list[workloads.BenchRequest], rows: list[dict]) -> dict[str, Any] | None:
    """The input/output lengths sent: synthetic's drawn lengths, or the server's usage counts."""
    if cfg.workload == "synthetic":
        ins = [r.meta["input_len"] for r in requests]
        outs = [r.meta["output_len"] for r in requests]
        src_in = cfg.input_len_dist or f"fixed {cfg.input_len}"
        src_out = cfg.output_len_dist or f"fixed {cfg.output_len}"
        what = "requested (prompt tokens sent, max_tokens with EOS ignored)"
    else:
        ins = [r["prompt_tokens"] for r in rows if r["ok"] and r.get("prompt_tokens")]
        outs = [r["output_tokens"] for r in rows if r["ok"]]
        src_in = src_out = "the server's usage per request"
        what = "measured (usage.prompt_tokens / completion_tokens)"
    if not ins and not outs:
        return None
    return {"what": what,
            "input": {"source": src_in, "summary": summarize(ins), "histogram": lengths.histogram(ins)},
            "output": {"source": src_out, "summary": summarize(outs), "histogram": lengths.histogram(outs)}}


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
        if cfg.workload == "replay":
            row.update(_replay_scores(req, res))
        rows.append(row)
    ok = [r for r in results if r.ok]
    errors = [r for r in results if not r.ok]
    if errors:
        warnings.append(f"{len(errors)} of {len(results)} requests failed; first error: {errors[0].error}")
    if ok and not all(r.usage_reported for r in ok):
        warnings.append("the server sent no usage in the stream for some requests: their output "
                        "token counts are output-chunk counts (TPOT is then approximate)")
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
        "prompt_tokens": summarize([r.prompt_tokens for r in ok if r.prompt_tokens is not None]),
        "accept_length_per_request": summarize([r.accept_length for r in ok if r.accept_length is not None]),
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
    elif cfg.workload == "replay":
        accuracy = replay_accuracy(rows)
    spec = None
    if run["spec_after"] is not None and run["spec_before"] is not None:
        spec = scrape.spec_decode_delta(run["spec_before"], run["spec_after"])
    if run["metrics_error"]:
        warnings.append(f"no speculative-decoding metrics: {run['metrics_error']}")
    facts = run["facts"]
    if facts.get("report") is None:
        warnings.append(f"no vllm-ling verification report: {facts['sources']['report']}")
    for w in warnings:
        logger.warning(w)
    config = dataclasses.asdict(cfg)
    config.pop("api_key", None)  # never write a secret
    config["token_id_range"] = list(cfg.token_id_range)
    config["concurrency"] = concurrency_of(cfg)
    return {
        "schema": RESULTS_SCHEMA,
        "label": cfg.label or f"{cfg.workload} @ {cfg.base_url}",
        "started_at": _dt.datetime.fromtimestamp(run["started"], _dt.timezone.utc).isoformat(),
        "server": {"base_url": cfg.base_url, "model": run["model"], "facts": facts},
        "config": config,
        "summary": summary,
        "lengths": _lengths_sent(cfg, requests, rows),
        "spec_decode": spec,
        "accuracy": accuracy,
        "warnings": warnings,
        "requests": rows,
    }


def validate(cfg: BenchConfig) -> None:
    if cfg.concurrency is not None and cfg.concurrency < 1:
        raise BenchError(f"--concurrency must be >= 1, got {cfg.concurrency}")
    if cfg.request_rate is not None and not cfg.request_rate > 0:
        raise BenchError(f"--request-rate must be > 0 requests/s, got {cfg.request_rate}")
    if cfg.metrics_interval_s < 0:
        raise BenchError(f"--metrics-interval must be >= 0 s, got {cfg.metrics_interval_s}")
    if cfg.workload == "replay" and not cfg.requests_file:
        raise BenchError("--workload replay needs --requests FILE.jsonl (one OpenAI chat request per line)")
    if cfg.requests_file and cfg.workload != "replay":
        raise BenchError(f"--requests is for --workload replay (got --workload {cfg.workload})")
    if (cfg.input_len_dist or cfg.output_len_dist) and cfg.workload != "synthetic":
        raise BenchError("--input-len-dist/--output-len-dist shape the synthetic workload only")
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
        if cfg.server_report:
            server_facts.load_report_file(cfg.server_report)  # a bad file fails before any request
    except (ValueError, gsm8k.DatasetError) as exc:  # ReplayError, LengthSpecError, FactsError too
        raise BenchError(str(exc)) from exc
    run = asyncio.run(_run(cfg, requests))
    results = summarize_run(cfg, requests, run)
    if cfg.out_dir:
        from vllm_ling.bench import results_files  # noqa: PLC0415

        results["files"] = results_files.write_all(results, cfg.out_dir, plots=cfg.plots)
    return results
