"""Streaming OpenAI-compatible client: one ``/v1/completions`` or ``/v1/chat/completions``
request, timed per chunk.

TTFT is the time to the first chunk carrying output (text; for chat also reasoning or a
tool-call delta); ITL is the gap between consecutive such chunks (a chunk may carry several
tokens, e.g. with MTP); the output token count comes from the final ``usage`` chunk
(``stream_options.include_usage``), falling back to the number of output chunks when a server
sends no usage. Chat tool calls are assembled from their streamed deltas (by ``index``).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import aiohttp

from vllm_ling.bench.workloads import BenchRequest


class ServerError(RuntimeError):
    """The server could not be reached or answered something unusable."""


@dataclass
class RequestResult:
    request_id: str
    ok: bool = False
    error: str | None = None
    ttft_s: float | None = None
    e2e_s: float | None = None
    tpot_s: float | None = None
    itl_s: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    output_tokens: int = 0
    usage_reported: bool = False
    finish_reason: str | None = None
    text: str = ""  # completion text, or the chat answer's content
    reasoning: str = ""  # chat: the parsed reasoning (``reasoning`` / ``reasoning_content``)
    tool_calls: list[dict[str, Any]] = field(default_factory=list)  # chat: [{id, name, arguments}]
    send_offset_s: float | None = None  # when it was sent, from the start of the run
    accept_length: float | None = None  # from /metrics deltas around it (requests one at a time)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def auth_headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


async def get_json(session: aiohttp.ClientSession, url: str, api_key: str | None = None,
                   timeout_s: float = 30.0) -> Any:
    try:
        async with session.get(url, headers=auth_headers(api_key),
                               timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            body = await resp.text()
            if resp.status != 200:
                raise ServerError(f"GET {url}: HTTP {resp.status}: {body[:300]}")
            return json.loads(body)
    except aiohttp.ClientError as exc:
        raise ServerError(f"GET {url}: {exc.__class__.__name__}: {exc}") from exc
    except json.JSONDecodeError as exc:
        raise ServerError(f"GET {url}: not JSON ({exc})") from exc


async def first_model(session: aiohttp.ClientSession, base_url: str, api_key: str | None) -> str:
    data = await get_json(session, f"{base_url}/v1/models", api_key)
    models = data.get("data") or []
    if not models:
        raise ServerError(f"{base_url}/v1/models lists no model; pass --model")
    return models[0]["id"]


def _completion_output(res: RequestResult, choice: dict[str, Any]) -> bool:
    text = choice.get("text") or ""
    res.text += text
    return bool(text)


def _chat_output(res: RequestResult, choice: dict[str, Any]) -> bool:
    delta = choice.get("delta") or {}
    content = delta.get("content") or ""
    reasoning = delta.get("reasoning") or delta.get("reasoning_content") or ""
    res.text += content
    res.reasoning += reasoning
    calls = delta.get("tool_calls") or []
    for call in calls:
        index = int(call.get("index", len(res.tool_calls)))
        while len(res.tool_calls) <= index:
            res.tool_calls.append({"id": None, "name": "", "arguments": ""})
        slot = res.tool_calls[index]
        slot["id"] = call.get("id") or slot["id"]
        fn = call.get("function") or {}
        slot["name"] += fn.get("name") or ""
        slot["arguments"] += fn.get("arguments") or ""
    return bool(content or reasoning or calls)


async def stream_completion(
    session: aiohttp.ClientSession, base_url: str, model: str, req: BenchRequest,
    api_key: str | None, timeout_s: float,
) -> RequestResult:
    """Send ``req`` (a completion, or a chat request when ``req.chat``) and time its stream."""
    if req.chat:
        url, on_choice = f"{base_url}/v1/chat/completions", _chat_output
        body = {**req.params, "model": model, "stream": True, "stream_options": {"include_usage": True}}
    else:
        url, on_choice = f"{base_url}/v1/completions", _completion_output
        body = {"model": model, "prompt": req.prompt, "stream": True,
                "stream_options": {"include_usage": True}, **req.params}
    res = RequestResult(request_id=req.request_id)
    chunks_with_output = 0
    last_t: float | None = None
    start = time.perf_counter()
    try:
        async with session.post(url, json=body, headers=auth_headers(api_key),
                                timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            if resp.status != 200:
                res.error = f"HTTP {resp.status}: {(await resp.text())[:300]}"
                return res
            buffer = b""
            async for raw in resp.content:
                buffer += raw
                while b"\n" in buffer:
                    line, buffer = buffer.split(b"\n", 1)
                    line = line.strip()
                    if not line.startswith(b"data:"):
                        continue
                    payload = line[5:].strip()
                    if payload == b"[DONE]":
                        continue
                    now = time.perf_counter()
                    chunk = json.loads(payload)
                    if "error" in chunk:
                        res.error = f"server error in stream: {chunk['error']}"
                        return res
                    for choice in chunk.get("choices") or []:
                        if on_choice(res, choice):
                            if res.ttft_s is None:
                                res.ttft_s = now - start
                            elif last_t is not None:
                                res.itl_s.append(now - last_t)
                            last_t = now
                            chunks_with_output += 1
                        if choice.get("finish_reason"):
                            res.finish_reason = choice["finish_reason"]
                    usage = chunk.get("usage")
                    if usage:
                        res.usage_reported = True
                        res.output_tokens = int(usage.get("completion_tokens") or 0)
                        res.prompt_tokens = usage.get("prompt_tokens")
    except asyncio.TimeoutError:
        res.error = f"timed out after {timeout_s:g} s"
        return res
    except aiohttp.ClientError as exc:
        res.error = f"{exc.__class__.__name__}: {exc}"
        return res
    except json.JSONDecodeError as exc:
        res.error = f"bad SSE payload: {exc}"
        return res
    end = time.perf_counter()
    res.e2e_s = end - start
    if not res.usage_reported:
        res.output_tokens = chunks_with_output
    if res.ttft_s is None:
        res.error = "no output streamed"
        return res
    if res.output_tokens > 1:
        res.tpot_s = (res.e2e_s - res.ttft_s) / (res.output_tokens - 1)
    res.ok = True
    return res
