"""``make demo``: what vllm-ling does, on this machine, in under a minute on 2 idle CPU cores (README).

Makes the scripted tiny Ling-3.0 checkpoint (real architecture and -fp4 storage format; its
greedy answer to a chat is a reasoning block and a ``get_weather`` tool call, and its NEXTN
draft predicts every token of it), serves it with real vLLM + vllm-ling and the Ling-3
parsers (``--enable-auto-tool-choice --tool-call-parser ling3 --reasoning-parser ling3``, as
``vllm-ling serve`` adds them), then shows:

1. a chat answer as an OpenAI client gets it: reasoning separated from the content, and the
   tool call parsed into ``tool_calls`` (speculative decoding on);
2. the MTP accept length of that request from the server's ``/metrics`` (about 4 with 3
   draft tokens: the draft agrees with the target);
3. the startup verification table: which optimizations and checks are active on this
   machine, and why (on CPU the kernels are the plain-PyTorch references).

On a GPU machine pass ``--model /path/to/Ling-3.0-flash-fp4`` (the answer then is the model's).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import requests

from vllm_ling.cli.agent_defaults import LING_PARSER_ARGS
from vllm_ling.launcher.local_server import SERVE_ARGS, scrape, serve_tiny, wait_healthy

PARSER_ARGS = list(LING_PARSER_ARGS)  # what `vllm-ling serve` adds
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {"city": {"type": "string"}}}}}]
QUESTION = "How is the weather in Paris?"


def _spec_counters(base: str) -> tuple[float, float]:
    m = scrape(base)
    drafts = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_drafts_total"))
    accepted = sum(v for k, v in m.items() if k.startswith("vllm:spec_decode_num_accepted_tokens_total"))
    return drafts, accepted


def _verification(report: dict) -> str:
    from vllm_ling.runtime.verification import format_table

    lines = [format_table(report), "  optimizations (requested -> active: detail):"]
    for name, o in report["optimizations"].items():
        state = "ACTIVE" if o["active"] else ("inactive" if o["requested"] else "not requested")
        lines.append(f"    {name:<20} {state:<13} {o['detail']}")
    return "\n".join(lines)


# `make demo` on an idle 2-core CPU machine: the tiny server healthy about 45 s after it starts
# (README, "Two commands"); it keeps about two cores busy while it starts.
IDLE_START_S = {"cpu": 45.0, "cuda": 60.0}
START_CORES = 2.0


def start_estimate(device: str, cores: int | None = None, load: float | None = None) -> str:
    """How long the server's start should take on this machine: the idle 2-core time, stretched by
    what else keeps these cores busy (the 1-minute load average)."""
    cores = cores or os.cpu_count() or 1
    if load is None:
        try:
            load = os.getloadavg()[0]
        except OSError:
            load = 0.0
    seconds = IDLE_START_S[device] * max(1.0, (load + START_CORES) / cores)
    shown = f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.0f} minutes"
    return f"about {shown} here: {cores} cores, load {load:.1f}"


def last_step(log: Path, width: int = 110) -> str:
    """The server log's last line, without vLLM's prefix (what it is doing now)."""
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.strip()] if log.exists() else []
    if not lines:
        return "(nothing logged yet)"
    line = lines[-1].split("] ", 1)[-1].strip()
    return line if len(line) <= width else line[:width - 3] + "..."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ling demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint dir (default: make the scripted tiny one)")
    parser.add_argument("--out", default="out/demo", help="where the tiny checkpoint and logs go")
    args = parser.parse_args(argv)
    start = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from vllm_ling.models.scripted_checkpoint import EXAMPLE_SCRIPT
        from vllm_ling.models.tiny_checkpoint import make_tiny

        model = make_tiny(out / "tiny-ling3-scripted", seed=0, script=EXAMPLE_SCRIPT)
        print(f"[{time.monotonic() - start:5.0f} s] made the scripted tiny Ling-3.0 checkpoint {model}\n"
              f"          its greedy answer: {EXAMPLE_SCRIPT!r}")
    log, report_path = out / "server.log", (out / "report.json").resolve()
    report_path.unlink(missing_ok=True)
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"  # the GPU build: CUDA graphs + torch.compile
    print(f"[{time.monotonic() - start:5.0f} s] starting vllm serve {model} {' '.join(PARSER_ARGS)} on {device} "
          f"(log: {log}; {start_estimate(device)}) ...", flush=True)
    server = serve_tiny(model, log, extra_args=PARSER_ARGS, device=device, wait=False, env={
        "VLLM_PLUGINS": "vllm_ling,vllm_ling_report", "VLLM_LING_REPORT_PATH": str(report_path)})
    try:
        wait_healthy(server, progress=lambda waited: print(
            f"[{time.monotonic() - start:5.0f} s] still starting: {last_step(log)}", flush=True))
        print(f"[{time.monotonic() - start:5.0f} s] server healthy at {server.base_url}\n")
        d0, a0 = _spec_counters(server.base_url)
        r = requests.post(server.base_url + "/v1/chat/completions", timeout=600, json={
            "model": "tiny", "messages": [{"role": "user", "content": QUESTION}], "tools": TOOLS,
            "temperature": 0, "max_tokens": 100})
        r.raise_for_status()
        choice = r.json()["choices"][0]
        message = choice["message"]
        d1, a1 = _spec_counters(server.base_url)
        print(f"1. POST /v1/chat/completions with tools=[get_weather]: {QUESTION!r}")
        print(f"   reasoning : {message.get('reasoning')!r}")
        print(f"   content   : {message.get('content')!r}")
        for call in message.get("tool_calls") or []:
            print(f"   tool call : {call['function']['name']}({call['function']['arguments']})")
        print(f"   finish    : {choice['finish_reason']}")
        if d1 > d0:
            print(f"\n2. MTP accept length of that request (from /metrics): {1 + (a1 - a0) / (d1 - d0):.2f} "
                  f"({a1 - a0:.0f} of {3 * (d1 - d0):.0f} draft tokens accepted over {d1 - d0:.0f} drafts; "
                  f"3 draft tokens: at most 4)")
        else:
            print("\n2. no speculative drafts counted: MTP is off")
        report = json.loads(report_path.read_text())
        print("\n3. " + _verification(report))
        print(f"\nserver flags: {' '.join(SERVE_ARGS[device] + PARSER_ARGS)} (see {log}); report: {report_path}")
    finally:
        rc = server.stop()
    print(f"[{time.monotonic() - start:5.0f} s] server stopped (exit code {rc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
