"""``make demo``: real vLLM + vllm-ling serving the tiny Ling-3.0 checkpoint on localhost.

Makes the tiny hybrid checkpoint (KDA + MLA + MoE + NEXTN layer, real -fp4 format),
starts ``vllm serve`` (vLLM's own CLI, plugin auto-loaded) on a free port, sends one
completion and one chat request, prints the verification summary and a few metrics,
then stops the server. On a GPU machine pass ``--model /path/to/Ling-3.0-flash-fp4``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import requests

from vllm_ling.runtime.local_server import CPU_SERVE_ARGS, scrape, serve_cpu


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m vllm_ling.cli.demo")
    parser.add_argument("--model", default=None, help="checkpoint dir (default: make the tiny one)")
    parser.add_argument("--out", default="out/demo", help="where the tiny checkpoint and logs go")
    args = parser.parse_args(argv)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    model = Path(args.model) if args.model else None
    if model is None:
        from vllm_ling.models.tiny_checkpoint import make_tiny

        model = make_tiny(out / "tiny-ling3", seed=0)
        print(f"made tiny checkpoint {model}")
    log = out / "server.log"
    print(f"starting vllm serve {model} (log: {log}; first start takes a minute on 2 CPU cores) ...")
    server = serve_cpu(model, log)
    try:
        completion = requests.post(server.base_url + "/v1/completions", json={
            "model": "tiny", "prompt": "The tiny Ling model says", "max_tokens": 16,
            "temperature": 0}, timeout=300).json()
        print("completion:", json.dumps(completion["choices"][0]["text"]))
        chat = requests.post(server.base_url + "/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 16, "temperature": 0}, timeout=300).json()
        print("chat:", json.dumps(chat["choices"][0]["message"]["content"]))
        metrics = scrape(server.base_url)
        for key in sorted(metrics):
            if key.startswith(("vllm_ling:", "vllm:spec_decode_num_drafts", "vllm:spec_decode_num_accepted_tokens_total")):
                print(f"  {key} {metrics[key]:g}")
        print(f"server flags: {' '.join(CPU_SERVE_ARGS)} (see {log})")
        if not args.model:
            print("random weights: the NEXTN draft predicts nothing, so the accept length is ~1.0; "
                  "`vllm-ling make-tiny --agreeing DIR` builds a checkpoint whose draft accepts every token")
    finally:
        rc = server.stop()
    print(f"server stopped (exit code {rc})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
