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

from vllm_ling.bench.arguments import add_workload_args, bench_command, bench_config, run_parser
from vllm_ling.bench.runner import BenchConfig, BenchError, run_benchmark

__all__ = ["BenchConfig", "BenchError", "bench_command", "run_benchmark", "main"]

_USAGE = """usage: vllm-ling bench [run] [options]        benchmark one server (see `vllm-ling bench run -h`)
       vllm-ling bench compare A [B]             compare two results.json files (or run folders);
                                                 an ablation folder alone: each configuration vs
                                                 its baseline; two ablation folders: config by config
       vllm-ling bench ablation --model MODEL    launch and measure the four study configurations"""


def _run_main(argv: list[str]) -> int:
    args = run_parser().parse_args(argv)
    from vllm_ling.bench.client import ServerError  # noqa: PLC0415
    from vllm_ling.bench.results_files import markdown  # noqa: PLC0415

    try:
        results = run_benchmark(bench_config(args, base_url=args.base_url, api_key=args.api_key,
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
    from vllm_ling.bench.compare import compare, format_markdown, load_results, pairs  # noqa: PLC0415

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
    from vllm_ling.bench import ablation  # noqa: PLC0415

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
    add_workload_args(p)
    p.set_defaults(out_dir="ablation-results")
    args = p.parse_args(argv)
    settings = ablation.AblationSettings(
        model=args.model, out_dir=args.out_dir, server_command=args.server_cmd, server_args=args.server_args,
        host=args.host, port=args.port, configs=tuple(x for x in args.configs.split(",") if x),
        startup_timeout_s=args.startup_timeout, stop_timeout_s=args.stop_timeout, bench=bench_config(args),
        invocation=shlex.join(["vllm-ling", "bench", "ablation", *argv]))
    try:
        from vllm_ling.bench.runner import validate  # noqa: PLC0415

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
