"""The ``vllm-ling bench`` command line: flags to a :class:`BenchConfig` and back.

:func:`bench_command` writes the ``vllm-ling bench run`` command that reproduces a configuration
(``bench ablation`` records it in ``commands.sh``), from the same flag names the parser declares.
"""

from __future__ import annotations

import argparse
from typing import Any

from vllm_ling.bench.runner import BenchConfig


def _token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH, got {text!r}") from exc
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"needs 0 <= LOW < HIGH, got {text!r}")
    return low, high


def add_workload_args(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=("synthetic", "gsm8k", "replay"), default="synthetic")
    w.add_argument("--requests", dest="requests_file", metavar="FILE.jsonl",
                   help="replay: one OpenAI chat request per line (+ optional id, expected, usage)")
    w.add_argument("--shuffle", action="store_true", help="replay: send in a seeded random order")
    w.add_argument("--num-requests", type=int,
                   help="requests to send (default: 1 synthetic; every question for gsm8k; every line "
                        "for replay, which repeats or samples the file to reach N)")
    w.add_argument("--concurrency", type=int,
                   help="requests in flight at most (default 1; unbounded with --request-rate)")
    w.add_argument("--request-rate", type=float, metavar="PER_S",
                   help="send as a Poisson process of this many requests/s (seeded by --seed)")
    w.add_argument("--seed", type=int, default=0, help="prompt, order, arrival and sampling seed (default 0)")
    w.add_argument("--input-len", type=int, default=32768, help="synthetic prompt tokens (default 32768)")
    w.add_argument("--output-len", type=int, default=2048, help="synthetic output tokens (default 2048)")
    w.add_argument("--input-len-dist", metavar="SPEC",
                   help="synthetic prompt lengths drawn from 128,1024 or 128:3,1024:1 or a replay/results file")
    w.add_argument("--output-len-dist", metavar="SPEC", help="synthetic output lengths, same forms")
    w.add_argument("--token-id-range", type=_token_range, default=(10, 1000), metavar="LOW:HIGH",
                   help="synthetic prompt token ids are drawn from [LOW, HIGH) (default 10:1000)")
    w.add_argument("--max-tokens", type=int, default=32768, help="gsm8k max_tokens (default 32768)")
    w.add_argument("--dataset", help="gsm8k questions jsonl (default: the packaged 1,319 test questions)")
    w.add_argument("--fewshot", help="jsonl whose first 5 rows are the exemplars (default: built-in)")
    w.add_argument("--hf-dataset", action="store_true", help="load GSM8K from the Hugging Face hub (online)")
    w.add_argument("--request-timeout", type=float, default=3600.0, help="seconds per request")
    w.add_argument("--server-report", metavar="FILE",
                   help="the server's verification report file (default: GET /vllm_ling/report)")
    w.add_argument("--metrics-interval", type=float, default=1.0,
                   help="seconds between /metrics samples of KV-cache usage during the run (0: off)")
    o = p.add_argument_group("output")
    o.add_argument("--out-dir", default="bench-results", help="where results.json/.md and plots go")
    o.add_argument("--label", help="name for this run in tables")
    o.add_argument("--no-progress", action="store_true")
    o.add_argument("--no-plots", action="store_true")


def bench_config(args: argparse.Namespace, **extra: Any) -> BenchConfig:
    return BenchConfig(workload=args.workload, num_requests=args.num_requests, concurrency=args.concurrency,
                       request_rate=args.request_rate, seed=args.seed, input_len=args.input_len,
                       output_len=args.output_len, input_len_dist=args.input_len_dist,
                       output_len_dist=args.output_len_dist, requests_file=args.requests_file,
                       shuffle=args.shuffle, token_id_range=args.token_id_range, max_tokens=args.max_tokens,
                       dataset=args.dataset, fewshot=args.fewshot, hf_dataset=args.hf_dataset,
                       request_timeout_s=args.request_timeout, server_report=args.server_report,
                       metrics_interval_s=args.metrics_interval, out_dir=args.out_dir, label=args.label,
                       progress=not args.no_progress, plots=not args.no_plots, **extra)


# BenchConfig field -> `vllm-ling bench run` flag, for writing down the exact command of a run.
_FLAGS = (("workload", "--workload"), ("requests_file", "--requests"), ("num_requests", "--num-requests"),
          ("concurrency", "--concurrency"), ("request_rate", "--request-rate"), ("seed", "--seed"),
          ("input_len", "--input-len"), ("output_len", "--output-len"), ("input_len_dist", "--input-len-dist"),
          ("output_len_dist", "--output-len-dist"), ("max_tokens", "--max-tokens"), ("dataset", "--dataset"),
          ("fewshot", "--fewshot"), ("request_timeout_s", "--request-timeout"),
          ("server_report", "--server-report"), ("metrics_interval_s", "--metrics-interval"),
          ("out_dir", "--out-dir"), ("label", "--label"), ("base_url", "--base-url"), ("model", "--model"))


def bench_command(cfg: BenchConfig) -> list[str]:
    """The ``vllm-ling bench run`` argv that reproduces ``cfg`` (the API key is never written)."""
    argv = ["vllm-ling", "bench", "run"]
    for name, flag in _FLAGS:
        value = getattr(cfg, name)
        if value is not None:
            argv += [flag, str(value)]
    argv += ["--token-id-range", f"{cfg.token_id_range[0]}:{cfg.token_id_range[1]}"]
    argv += [flag for on, flag in ((cfg.shuffle, "--shuffle"), (cfg.hf_dataset, "--hf-dataset"),
                                   (not cfg.plots, "--no-plots")) if on]
    return argv


def run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-ling bench run",
                                description="Benchmark an OpenAI-compatible server (streaming /v1/completions; "
                                            "/v1/chat/completions for replay).")
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    s.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--model", help="model name (default: the first model of /v1/models)")
    add_workload_args(p)
    return p
