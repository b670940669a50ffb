"""A stand-in for vLLM's CLI under `vllm-ling serve` (tests/deploy/test_launch_last_lines.py): what
vLLM's API server does at the edges the launcher sees, in a second instead of a minute.

    python fake_vllm.py serve MODEL --port P ... [--unknown-flag ...]

- any flag it does not know: exits 2 as vLLM's parser does (usage + "unrecognized arguments");
- otherwise serves /health, /metrics (vLLM's spec-decode counters: FAKE_ACCEPTED accepted tokens
  of 3 per draft, 10 drafts per completion) and /v1/completions on 127.0.0.1:P;
- on SIGTERM it stops as vLLM 0.32 does on a CPU box: its shutdown lines, then, at interpreter
  exit, Triton's nanobind leak report (the last line without a newline) and multiprocessing's
  leaked-semaphore warning, then exit 0.
"""

from __future__ import annotations

import http.server
import json
import os
import signal
import sys
import threading

KNOWN = {"--host", "--port", "--served-model-name", "--max-model-len", "--max-num-seqs", "--tensor-parallel-size",
         "--pipeline-parallel-size", "--shutdown-timeout", "--tool-call-parser", "--reasoning-parser",
         "--enable-auto-tool-choice", "--enforce-eager", "--dtype", "--gpu-memory-utilization", "--seed"}
NANOBIND = ("nanobind: leaked 4 instances!\n"
            ' - leaked instance 0x7fd927eaeca8 of type "triton._C.libtriton.ir.attribute"\n'
            "nanobind: leaked 64 types!\n"
            ' - leaked type "triton._C.libtriton.ir.location"\n'
            " - ... skipped remainder\n"
            "nanobind: leaked 514 functions!\n"
            ' - leaked function "create_mul"\n'
            " - ... skipped remainder\n"
            "nanobind: this is likely caused by a reference counting issue in the binding code.\n"
            "See https://nanobind.readthedocs.io/en/latest/refleaks.html")
SEMAPHORE = ("/usr/lib/python3.11/multiprocessing/resource_tracker.py:254: UserWarning: resource_tracker: "
             "There appear to be 1 leaked semaphore objects to clean up at shutdown\n"
             "  warnings.warn('resource_tracker: There appear to be %d '\n")


def main(argv: list[str]) -> int:
    args = argv[2:]  # serve MODEL
    unknown = []  # as argparse names them: an unknown flag with the value after it
    for i, a in enumerate(args):
        if a.startswith("--") and a.split("=", 1)[0] not in KNOWN:
            unknown.append(a)
            if i + 1 < len(args) and not args[i + 1].startswith("--"):
                unknown.append(args[i + 1])
    if unknown:
        sys.stderr.write("usage: vllm serve [model_tag] [options]\n"
                         f"vllm serve: error: unrecognized arguments: {' '.join(unknown)}\n")
        return 2
    import resource

    print(f"fake-vllm: open files soft limit {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}", file=sys.stderr,
          flush=True)
    port = int(args[args.index("--port") + 1])
    accepted = float(os.environ.get("FAKE_ACCEPTED", "0"))
    counts = {"drafts": 0.0, "accepted": 0.0}

    class Handler(http.server.BaseHTTPRequestHandler):
        def _answer(self, body: bytes, kind: str = "application/json") -> None:
            self.send_response(200)
            self.send_header("Content-Type", kind)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/metrics":
                self._answer((f'vllm:spec_decode_num_drafts_total{{engine="0"}} {counts["drafts"]}\n'
                              f'vllm:spec_decode_num_accepted_tokens_total{{engine="0"}} {counts["accepted"]}\n'
                              ).encode(), "text/plain")
            else:
                self._answer(b"{}")

        def do_POST(self):
            self.rfile.read(int(self.headers.get("Content-Length", 0)))
            counts["drafts"] += 10
            counts["accepted"] += 10 * accepted
            self._answer(json.dumps({"choices": [{"text": "x"}]}).encode())

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    signal.signal(signal.SIGTERM, lambda *_: threading.Thread(target=server.shutdown).start())
    print("INFO:     Application startup complete.", flush=True)
    server.serve_forever()
    print("INFO:     Shutting down", flush=True)
    sys.stderr.write(SEMAPHORE)
    sys.stderr.write(NANOBIND)  # nanobind's last line has no newline
    sys.stderr.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
