"""A stand-in OpenAI-compatible server for testing the bench harness without a model.

``python -m vllm_ling.bench.standin --port 8123`` serves what ``vllm-ling bench``
uses: ``/health``, ``/v1/models``, streaming ``/v1/completions`` and ``/v1/chat/completions``
with usage, Prometheus ``/metrics`` with vLLM's spec-decode counters (advancing as it serves
when MTP is on), KV-cache usage and cache config, and ``/vllm_ling/report``. It reads the
ablation switches ``VLLM_LING_MOE_BACKEND``, ``VLLM_LING_FP8_HEAD`` and ``VLLM_LING_MTP`` and
reports them back, so the ablation orchestration can be tested end to end. Its "model" emits
placeholder words at a fixed pace; with ``--gsm8k-dataset`` it answers GSM8K questions right or
wrong by a fixed hash rule. Chat rules: a request with ``tools`` (and ``tool_choice`` not
``"none"``) gets one tool call, to the tool named in the last user message (else the first
tool), with the message's ``key=value`` words whose key is one of that tool's parameters as its
arguments; any other chat request gets ``echo: <last user message>`` (cut to ``max_tokens``
words), after a short reasoning when ``chat_template_kwargs.enable_thinking`` is true.
Nothing here measures a model: it is test scaffolding, shipped so users can try the harness.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager

from aiohttp import web

from vllm_ling.options import LingOptions, MoeBackend

ACCEPT_PATTERN = (3, 2, 3, 1, 0, 3)  # accepted drafts per verify step, cycled
NUM_SPEC = 3


class StandIn:
    def __init__(self, args: argparse.Namespace):
        self.model = args.model
        self.api_key = args.api_key
        env = dict(os.environ)
        for name in args.ignore_env or []:
            env.pop(name, None)  # simulate a server that silently drops a switch
        options = LingOptions.from_env(env)
        self.humming = options.moe_backend is MoeBackend.HUMMING
        self.fp8_head = options.fp8_head
        self.mtp = options.mtp and bool(env.get("VLLM_LING_MTP"))  # the stand-in drafts only when asked
        step = args.token_delay_ms / 1e3
        step *= 0.9 if self.humming else 1.0
        step *= 0.85 if self.fp8_head else 1.0
        self.step_s = step
        self.prefill_s_per_token = args.prefill_us_per_token / 1e6
        self.salt = args.salt
        self.answers: dict[str, str] = {}
        if args.gsm8k_dataset:
            from vllm_ling.bench.gsm8k import load_questions  # noqa: PLC0415

            self.answers = {q.question.strip(): q.answer for q in load_questions(args.gsm8k_dataset)}
        self.drafts = float(args.initial_drafts)
        self.accepted = float(args.initial_drafts)  # arbitrary nonzero history before a run
        self.per_pos = [float(args.initial_drafts) / (i + 1) for i in range(NUM_SPEC)]
        self.step_counter = 0
        self.running = 0
        self.started = time.time()

    def _authorized(self, request: web.Request) -> bool:
        return not self.api_key or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    def _words(self, prompt, max_tokens: int, ignore_eos: bool) -> list[str]:
        if isinstance(prompt, str) and "Question:" in prompt and not ignore_eos:
            question = prompt.rsplit("Question:", 1)[1].split("\nAnswer:", 1)[0].strip()
            gold = self.answers.get(question)
            if gold is None:
                answer = "7"
            elif zlib.crc32(f"{self.salt}:{question}".encode()) % 4 != 0:
                answer = gold
            else:
                answer = str(int(float(gold)) + 1)
            words = ["Let", "us", "reason:", "the", "numbers", "give", f"{answer}.", "\n####", answer]
            return words[:max_tokens]
        return [f" w{i % 97}" for i in range(max_tokens)]

    async def _accept(self, request: web.Request) -> tuple[dict | None, web.Response | None]:
        """The request body, or the error response a real server gives (bad key, wrong model)."""
        if not self._authorized(request):
            return None, web.json_response({"error": {"message": "bad api key"}}, status=401)
        body = await request.json()
        if body.get("model") != self.model:
            return None, web.json_response({"error": {"message": f"model {body.get('model')!r} not served"}},
                                           status=404)
        return body, None

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._accept(request)
        if refused is not None:
            return refused
        prompt = body["prompt"]
        prompt_tokens = len(prompt) if isinstance(prompt, list) else len(prompt.split())
        words = self._words(prompt, int(body.get("max_tokens", 16)), bool(body.get("ignore_eos")))
        finish = "length" if len(words) >= int(body.get("max_tokens", 16)) else "stop"
        if not body.get("stream"):
            await asyncio.sleep(self.step_s * len(words))
            return web.json_response({"choices": [{"index": 0, "text": " ".join(words), "finish_reason": finish}],
                                      "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(words)}})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await asyncio.sleep(self.prefill_s_per_token * prompt_tokens)

        async def send(obj) -> None:
            await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

        async def emit(piece: list, last: bool) -> None:
            await send({"id": "cmpl-standin", "object": "text_completion", "model": self.model,
                        "choices": [{"index": 0, "text": " ".join(piece),
                                     "finish_reason": finish if last else None}]})

        await self._steps(words, emit)
        await send({"id": "cmpl-standin", "object": "text_completion", "model": self.model, "choices": [],
                    "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(words),
                              "total_tokens": prompt_tokens + len(words)}})
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def _steps(self, pieces: list, emit) -> None:
        """Emit `pieces` at the decode pace (several per step with MTP, advancing the counters)."""
        i = 0
        while i < len(pieces):
            if self.mtp:
                accepted = ACCEPT_PATTERN[self.step_counter % len(ACCEPT_PATTERN)]
                self.step_counter += 1
                self.drafts += 1
                self.accepted += accepted
                for p in range(accepted):
                    self.per_pos[p] += 1
                n = accepted + 1
                await asyncio.sleep(self.step_s * 1.7)  # a verify step costs more than a plain one
            else:
                n = 1
                await asyncio.sleep(self.step_s)
            await emit(pieces[i:i + n], i + n >= len(pieces))
            i += n

    @staticmethod
    def _tool_call(body: dict) -> dict | None:
        tools = [t.get("function", {}) for t in body.get("tools") or [] if isinstance(t, dict)]
        if not tools or body.get("tool_choice") == "none":
            return None
        text = _last_user_text(body.get("messages") or [])
        tool = next((t for t in tools if t.get("name") and t["name"] in text), tools[0])
        params = (tool.get("parameters") or {}).get("properties") or {}
        args = {}
        for word in text.split():
            key, sep, value = word.partition("=")
            if sep and key in params:
                args[key] = value
        return {"name": tool.get("name", ""), "arguments": json.dumps(args)}

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body, refused = await self._accept(request)
        if refused is not None:
            return refused
        messages = body.get("messages") or []
        text = _last_user_text(messages)
        prompt_tokens = sum(len(str(m.get("content") or "").split()) for m in messages)
        max_tokens = int(body.get("max_tokens") or 16)
        call = self._tool_call(body)
        thinking = bool((body.get("chat_template_kwargs") or {}).get("enable_thinking"))
        reasoning = ["Thinking", "it", "over."] if thinking else []
        if call is not None:
            args = call["arguments"]
            pieces = [("reasoning", w) for w in reasoning] + [("name", call["name"]), ("args", args[: len(args) // 2]),
                                                               ("args", args[len(args) // 2:])]
            finish = "tool_calls"
        else:
            if "Question:" in text:
                words = self._words("Question:" + text.rsplit("Question:", 1)[1], max_tokens, False)
            else:
                words = ["echo:"] + text.split()
            words = words[:max_tokens]
            pieces = [("reasoning", w) for w in reasoning] + [("content", w) for w in words]
            finish = "length" if len(words) >= max_tokens else "stop"
        completion_tokens = len(pieces)
        self.running += 1
        try:
            if not body.get("stream"):
                await asyncio.sleep(self.step_s * len(pieces))
                message: dict = {"role": "assistant", "content": " ".join(v for k, v in pieces if k == "content")
                                 or None}
                if reasoning:
                    message["reasoning"] = " ".join(reasoning)
                if call is not None:
                    message["tool_calls"] = [{"id": "call-0", "type": "function", "function": call}]
                return web.json_response({"choices": [{"index": 0, "message": message, "finish_reason": finish}],
                                          "usage": {"prompt_tokens": prompt_tokens,
                                                    "completion_tokens": completion_tokens}})
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)

            async def send(obj) -> None:
                await resp.write(f"data: {json.dumps(obj)}\n\n".encode())

            base = {"id": "chatcmpl-standin", "object": "chat.completion.chunk", "model": self.model}
            await send({**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""}}]})
            await asyncio.sleep(self.prefill_s_per_token * prompt_tokens)

            sent_content, sent_reasoning = [0], [0]

            async def emit(group: list, last: bool) -> None:
                delta: dict = {}
                for kind, value in group:
                    if kind == "content":  # words separated by one space, across chunks too
                        delta["content"] = delta.get("content", "") + (" " if sent_content[0] else "") + value
                        sent_content[0] += 1
                    elif kind == "reasoning":  # likewise: a word starting a chunk keeps its space
                        delta["reasoning"] = delta.get("reasoning", "") + (" " if sent_reasoning[0] else "") + value
                        sent_reasoning[0] += 1
                    else:
                        call_delta = delta.setdefault("tool_calls", [{"index": 0, "function": {}}])[0]
                        if kind == "name":
                            call_delta.update(id="call-0", type="function")
                            call_delta["function"]["name"] = value
                        else:
                            call_delta["function"]["arguments"] = call_delta["function"].get("arguments", "") + value
                await send({**base, "choices": [{"index": 0, "delta": delta,
                                                 "finish_reason": finish if last else None}]})

            await self._steps(pieces, emit)
            await send({**base, "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                          "completion_tokens": completion_tokens,
                                                          "total_tokens": prompt_tokens + completion_tokens}})
            await resp.write(b"data: [DONE]\n\n")
            await resp.write_eof()
            return resp
        finally:
            self.running -= 1

    async def models(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"error": {"message": "bad api key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model",
                                                              "created": int(time.time())}]})

    async def metrics(self, request: web.Request) -> web.Response:
        labels = f'engine="0",model_name="{self.model}"'
        lines = ["# HELP vllm:num_requests_running Number of requests running.",
                 "# TYPE vllm:num_requests_running gauge",
                 f"vllm:num_requests_running{{{labels}}} {float(self.running)}",
                 f"vllm:num_requests_waiting{{{labels}}} 0.0",
                 # A made-up occupancy: 5% of the KV cache per running request.
                 f"vllm:kv_cache_usage_perc{{{labels}}} {min(1.0, 0.05 * self.running)}",
                 f'vllm:cache_config_info{{block_size="16",cache_dtype="auto",engine="0",'
                 f'gpu_memory_utilization="0.9",num_gpu_blocks="1024"}} 1.0',
                 f'vllm_ling:info{{model_name="{self.model}",vllm_version="standin",platform="cpu",'
                 f'moe_backend="{"humming" if self.humming else "vllm"}"}} 1.0']
        if self.mtp:
            lines += [
                "# TYPE vllm:spec_decode_num_drafts_total counter",
                f"vllm:spec_decode_num_drafts_total{{{labels}}} {self.drafts}",
                "# TYPE vllm:spec_decode_num_draft_tokens_total counter",
                f"vllm:spec_decode_num_draft_tokens_total{{{labels}}} {self.drafts * NUM_SPEC}",
                "# TYPE vllm:spec_decode_num_accepted_tokens_total counter",
                f"vllm:spec_decode_num_accepted_tokens_total{{{labels}}} {self.accepted}",
                "# TYPE vllm:spec_decode_num_accepted_tokens_per_pos_total counter",
            ]
            lines += [f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{{labels},position="{p}"}} {v}'
                      for p, v in enumerate(self.per_pos)]
        return web.Response(text="\n".join(lines) + "\n", content_type="text/plain")

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="")

    async def report(self, request: web.Request) -> web.Response:
        # Same shape as the real startup-verification report (vllm_ling.runtime.verification).
        def opt(active: bool) -> dict:
            return {"requested": active, "active": active, "detail": "stand-in"}

        return web.json_response({
            "standin": True, "passed": True, "policy": "strict", "platform": "cpu", "gpu_arch": None,
            "versions": {"vllm": "standin", "humming": None},
            "optimizations": {"moe_humming": opt(self.humming), "fp8_head": opt(self.fp8_head),
                              "mtp": opt(self.mtp)},
            "moe_backend": "humming" if self.humming else "vllm",
            "head_dtype": "float8_e4m3fn" if self.fp8_head else "bfloat16",
            "spec_method": "mtp" if self.mtp else None, "num_speculative_tokens": NUM_SPEC if self.mtp else 0,
            "checks": [{"name": "standin", "passed": True, "expected": "-", "actual": "-", "fix": ""}],
            "smoke": {"accept_length": None, "threshold": 0.0, "passed": None}})


def _last_user_text(messages: list) -> str:
    for m in reversed(messages):
        if isinstance(m, dict) and m.get("role") == "user":
            content = m.get("content")
            if isinstance(content, list):
                return " ".join(p.get("text", "") for p in content if isinstance(p, dict))
            return str(content or "")
    return ""


def build_app(args: argparse.Namespace) -> web.Application:
    s = StandIn(args)
    app = web.Application()
    app.router.add_post("/v1/completions", s.completions)
    app.router.add_post("/v1/chat/completions", s.chat)
    app.router.add_get("/v1/models", s.models)
    app.router.add_get("/metrics", s.metrics)
    app.router.add_get("/health", s.health)
    app.router.add_get("/vllm_ling/report", s.report)
    return app


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m vllm_ling.bench.standin", description=__doc__.split("\n")[0])
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8123)
    p.add_argument("--model", default="standin")
    p.add_argument("--api-key", help="require this bearer token")
    p.add_argument("--token-delay-ms", type=float, default=2.0, help="time per decode step")
    p.add_argument("--prefill-us-per-token", type=float, default=1.0)
    p.add_argument("--gsm8k-dataset", help="jsonl whose answers the stand-in knows")
    p.add_argument("--salt", default="", help="changes which GSM8K questions it answers wrong")
    p.add_argument("--initial-drafts", type=int, default=100, help="spec-decode counter history at start")
    p.add_argument("--ignore-env", action="append", help="pretend this env var was not set (repeatable)")
    return p.parse_args(argv)


@contextmanager
def running_standin(*args: str, env: dict[str, str] | None = None, host: str = "127.0.0.1",
                    startup_timeout_s: float = 30.0) -> Iterator[str]:
    """Start the stand-in in a subprocess on a free port; yield its base URL; stop it."""
    import tempfile  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415

    from vllm_ling.launcher.local_server import free_port, start_server  # noqa: PLC0415

    port = free_port(host)
    with tempfile.TemporaryDirectory(prefix="standin-") as tmp:
        server = start_server(
            [sys.executable, "-m", "vllm_ling.bench.standin", "--host", host, "--port", str(port), *args],
            {**os.environ, **(env or {})}, Path(tmp) / "standin.log", port, host=host, timeout=startup_timeout_s)
        try:
            yield server.base_url
        finally:
            server.stop(timeout=10)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    web.run_app(build_app(args), host=args.host, port=args.port, print=None, access_log=None)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
