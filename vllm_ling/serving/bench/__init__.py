"""``vllm-ling bench``: the study's measurements against any OpenAI-compatible server.

    vllm-ling bench [run] --base-url URL --workload synthetic|gsm8k|replay ...   measure one server
    vllm-ling bench compare A B        B - A with CIs, McNemar (results.json files or folders)
    vllm-ling bench ablation --model MODEL ...                                  the four configurations

Python API: :func:`run_benchmark` (see ``runner.py``). Imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from typing import Any

from vllm_ling.serving.bench.runner import BenchConfig, BenchError, run_benchmark

__all__ = ["BenchConfig", "BenchError", "run_benchmark", "main"]

_USAGE = """usage: vllm-ling bench [run] [options]        benchmark one server (see `vllm-ling bench run -h`)
       vllm-ling bench compare A [B]             compare two results.json files (or run folders);
                                                 an ablation folder alone: each configuration vs
                                                 its baseline; two ablation folders: config by config
       vllm-ling bench ablation --model MODEL    launch and measure the four study configurations"""


def _token_range(text: str) -> tuple[int, int]:
    try:
        low, high = (int(x) for x in text.split(":"))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected LOW:HIGH, got {text!r}") from exc
    if not 0 <= low < high:
        raise argparse.ArgumentTypeError(f"needs 0 <= LOW < HIGH, got {text!r}")
    return low, high


def _add_workload_args(p: argparse.ArgumentParser) -> None:
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


def _bench_config(args: argparse.Namespace, **extra: Any) -> BenchConfig:
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


def _run_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="vllm-ling bench run",
                                description="Benchmark an OpenAI-compatible server (streaming /v1/completions; "
                                            "/v1/chat/completions for replay).")
    s = p.add_argument_group("server")
    s.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    s.add_argument("--api-key", help="bearer token (default: $OPENAI_API_KEY if set)")
    s.add_argument("--model", help="model name (default: the first model of /v1/models)")
    _add_workload_args(p)
    return p


def _run_main(argv: list[str]) -> int:
    args = _run_parser().parse_args(argv)
    from vllm_ling.serving.bench.client import ServerError  # noqa: PLC0415
    from vllm_ling.serving.bench.report import markdown  # noqa: PLC0415

    try:
        results = run_benchmark(_bench_config(args, base_url=args.base_url, api_key=args.api_key,
                                              model=args.model))
    except BenchError as exc:
        print(f"vllm-ling bench: error: {exc}", file=sys.stderr)
        return 2
    except ServerError as exc:
        print(f"vllm-ling bench: error: {exc}", file=sys.stderr)
        return 1
    print(markdown(results))
    print(f"wrote {', '.join(results['files'])} to {args.out_dir}")
    return 0 if results["summary"]["num_ok"] else 1


def _compare_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="vllm-ling bench compare",
        description="B - A with bootstrap CIs; exact McNemar on scored runs (GSM8K, replay with expected "
                    "answers); what differed between the servers. A and B: results.json files or their "
                    "folders; one ablation folder: each configuration vs its baseline; two ablation "
                    "folders: configuration by configuration.")
    p.add_argument("a", help="baseline results.json (or its folder, or an ablation folder)")
    p.add_argument("b", nargs="?", help="candidate results.json (or folder); omit with one ablation folder")
    p.add_argument("--json", help="write the comparison as JSON here")
    p.add_argument("--md", help="write the comparison as Markdown here")
    p.add_argument("--seed", type=int, help="bootstrap seed (default: fixed)")
    args = p.parse_args(argv)
    from vllm_ling.serving.bench.compare import compare, format_markdown, load_results, pairs  # noqa: PLC0415

    try:
        comparisons = []
        for title, path_a, path_b in pairs(args.a, args.b):
            result = compare(load_results(path_a), load_results(path_b), seed=args.seed)
            result["title"] = title
            comparisons.append(result)
    except BenchError as exc:
        print(f"vllm-ling bench compare: error: {exc}", file=sys.stderr)
        return 2
    text = "\n".join((f"# {c['title']}\n\n" if c["title"] else "") + format_markdown(c) for c in comparisons)
    print(text)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(comparisons[0] if len(comparisons) == 1 else {"comparisons": comparisons}, f, indent=2)
    if args.md:
        with open(args.md, "w") as f:
            f.write(text)
    return 0


def _ablation_main(argv: list[str]) -> int:
    from vllm_ling.serving.bench import ablation  # noqa: PLC0415

    names = ", ".join(c.name for c in ablation.ABLATION_CONFIGS)
    p = argparse.ArgumentParser(
        prog="vllm-ling bench ablation",
        description="Launch the server in each study configuration, verify its report, measure, stop.")
    s = p.add_argument_group("server")
    s.add_argument("--model", required=True, help="model path or name given to the server command")
    s.add_argument("--server-cmd", default=ablation.DEFAULT_SERVER_COMMAND,
                   help="command template; placeholders {model} {host} {port} {python} "
                        f"(default: {ablation.DEFAULT_SERVER_COMMAND!r})")
    s.add_argument("--server-args", default="", help="extra arguments appended to every server command")
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, help="server port (default: a free port per configuration)")
    s.add_argument("--configs", default=",".join(c.name for c in ablation.ABLATION_CONFIGS),
                   help=f"comma-separated subset, in order (default: {names})")
    s.add_argument("--startup-timeout", type=float, default=1800.0, help="seconds to wait for /health")
    s.add_argument("--stop-timeout", type=float, default=60.0, help="seconds between SIGTERM and SIGKILL")
    _add_workload_args(p)
    p.set_defaults(out_dir="ablation-results")
    args = p.parse_args(argv)
    settings = ablation.AblationSettings(
        model=args.model, out_dir=args.out_dir, server_command=args.server_cmd, server_args=args.server_args,
        host=args.host, port=args.port, configs=tuple(x for x in args.configs.split(",") if x),
        startup_timeout_s=args.startup_timeout, stop_timeout_s=args.stop_timeout, bench=_bench_config(args),
        invocation=shlex.join(["vllm-ling", "bench", "ablation", *argv]))
    try:
        from vllm_ling.serving.bench.runner import validate  # noqa: PLC0415

        validate(settings.bench)
        result = ablation.run_ablation(settings)
    except BenchError as exc:
        print(f"vllm-ling bench ablation: error: {exc}", file=sys.stderr)
        return 2
    except ablation.AblationError as exc:
        print(f"vllm-ling bench ablation: error: {exc}", file=sys.stderr)
        return 1
    print(ablation.ablation_markdown(result["rows"]))
    print(f"wrote ablation.json, ablation.md, commands.sh and one folder per configuration to {args.out_dir}; "
          f"compare later with `vllm-ling bench compare {args.out_dir} NEW_FOLDER`")
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("-h", "--help", "help"):
        print(_USAGE)
        return 0
    if argv and argv[0] == "compare":
        return _compare_main(argv[1:])
    if argv and argv[0] == "ablation":
        return _ablation_main(argv[1:])
    if argv and argv[0] == "run":
        argv = argv[1:]
    return _run_main(argv)
