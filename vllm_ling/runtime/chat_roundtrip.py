"""Startup round-trip check: the served chat template and the configured parsers agree.

Runs in the API-server process (from vllm-ling's endpoint plugin, after vLLM built its OpenAI
serving state) on the objects vLLM serves requests with: the ``OnlineRenderer`` (its renderer,
tokenizer, resolved chat template and default chat-template kwargs) and its composed
``Parser`` class (``--reasoning-parser`` / ``--tool-call-parser``). It renders a canonical
conversation twice -- up to the generation prompt, and with an assistant turn holding
reasoning and a tool call -- and takes the difference as the text the model would generate
(without the end-of-turn token, which vLLM stops on). It then parses that text the way the
chat endpoint does, whole and token by token (streaming), and requires the parsed reasoning,
tool name and arguments to equal the originals.

Why: a wrong or missing parser does not fail requests, it silently returns tool calls as
plain text and reasoning inside ``content``.

Outcomes: ``passed``; ``failed`` (the detail names template and parsers; refused under
``VLLM_LING_VERIFY=strict``); ``off by request`` (no parser configured).
"""

from __future__ import annotations

import copy
import dataclasses
import json
from typing import Any

from vllm_ling.runtime.verification.policy import LingVerificationError

PASSED, FAILED, OFF = "passed", "failed", "off by request"
CHECK_NAME = "chat_roundtrip"

TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Weather forecast for a city",
    "parameters": {"type": "object", "required": ["city"], "properties": {
        "city": {"type": "string"}, "days": {"type": "integer"}}}}}
ARGUMENTS = {"city": "Paris", "days": 3}
REASONING = "The user wants the forecast for Paris; get_weather answers that."
PROMPT_MESSAGES = [
    {"role": "system", "content": "You are a helpful assistant."},
    {"role": "user", "content": "What will the weather be in Paris for the next 3 days?"},
]


@dataclasses.dataclass
class RoundtripResult:
    status: str
    reasoning_parser: str | None
    tool_parser: str | None
    template: str
    detail: str
    fix: str = ""

    @property
    def passed(self) -> bool:
        return self.status != FAILED

    def as_check(self) -> dict[str, Any]:
        """The report's check row (``verification.checks.Check`` fields)."""
        return {"name": CHECK_NAME, "passed": self.passed,
                "expected": "reasoning and get_weather(city=Paris, days=3) parsed back as rendered",
                "actual": f"{self.status}: {self.detail}", "fix": self.fix}

    def as_report(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def parser_flags(args) -> tuple[str | None, str | None, bool]:
    """(reasoning parser, tool-call parser, --enable-auto-tool-choice) from vLLM's serve args."""
    so = getattr(args, "structured_outputs_config", None)
    reasoning = getattr(so, "reasoning_parser", None) or getattr(args, "reasoning_parser", None) or None
    return reasoning, getattr(args, "tool_call_parser", None) or None, bool(
        getattr(args, "enable_auto_tool_choice", False))


def template_source(chat_template_arg: str | None) -> str:
    """How the report names the template: vLLM's --chat-template value, or the tokenizer's."""
    if chat_template_arg is None:
        return "the model's tokenizer chat template"
    shown = chat_template_arg if len(chat_template_arg) < 120 and "\n" not in chat_template_arg else "(inline text)"
    return f"--chat-template {shown}"


def _thinking_on(kwargs: dict[str, Any]) -> bool:
    """The ling3/GLM convention: thinking unless enable_thinking/thinking says otherwise."""
    flags = [kwargs.get(k) for k in ("enable_thinking", "thinking") if kwargs.get(k) is not None]
    return not flags or any(bool(f) for f in flags)


def _render(online_renderer, messages, tool_dicts, add_generation_prompt: bool) -> str:
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(model="vllm-ling-roundtrip", messages=messages, tools=[TOOL],
                                    add_generation_prompt=add_generation_prompt)
    params = request.build_chat_params(
        online_renderer.chat_template, online_renderer.chat_template_content_format).with_defaults(
        {**online_renderer.default_chat_template_kwargs, "tools": tool_dicts, "tokenize": False})
    _, prompt = online_renderer.renderer.render_messages(copy.deepcopy(messages), params)
    text = prompt.get("prompt")
    if text is None:  # a tokenizing renderer: go back to text
        text = online_renderer.renderer.get_tokenizer().decode(prompt["prompt_token_ids"])
    return text


def _stop_ids(online_renderer, tokenizer) -> set[int]:
    ids = {tokenizer.eos_token_id} if tokenizer.eos_token_id is not None else set()
    try:
        eos = online_renderer.model_config.try_get_generation_config().get("eos_token_id")
    except Exception:  # noqa: BLE001 - no generation config: the tokenizer's EOS only
        eos = None
    ids |= {eos} if isinstance(eos, int) else set(eos or ())
    return ids


def _stream(parser_cls, tokenizer, request, kwargs, model_config, ids, prompt_ids):
    """Feed the output token by token as the streaming endpoint does; join the deltas."""
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs, model_config=model_config)
    reasoning, content, calls = "", "", {}
    previous = ""
    for i in range(len(ids)):
        text = tokenizer.decode(ids[:i + 1], skip_special_tokens=request.skip_special_tokens)
        delta, previous = text[len(previous):], text
        msg = parser.parse_delta(delta, [ids[i]], request, prompt_ids, finished=i == len(ids) - 1)
        if msg is None:
            continue
        reasoning += msg.reasoning or ""
        content += msg.content or ""
        for call in msg.tool_calls or []:
            slot = calls.setdefault(call.index, {"name": "", "arguments": ""})
            if call.function is not None:
                slot["name"] += call.function.name or ""
                slot["arguments"] += call.function.arguments or ""
    return reasoning or None, content or None, [calls[k] for k in sorted(calls)]


def _compare(mode: str, reasoning, content, calls, want_reasoning: str | None,
             tool_parser: bool) -> list[str]:
    problems = []
    if want_reasoning is not None and (reasoning or "").strip() != want_reasoning:
        problems.append(f"{mode}: reasoning {reasoning!r}, expected {want_reasoning!r}")
    if tool_parser:
        if len(calls) != 1:
            problems.append(f"{mode}: {len(calls)} tool calls parsed, expected 1 (content {content!r})")
        else:
            name, raw = calls[0]["name"], calls[0]["arguments"]
            try:
                args = json.loads(raw)
            except (TypeError, ValueError):
                args = raw
            if name != TOOL["function"]["name"] or args != ARGUMENTS:
                problems.append(f"{mode}: tool call {name}({raw}), expected "
                                f"{TOOL['function']['name']}({json.dumps(ARGUMENTS)})")
    if not problems and content and ("<tool_call>" in content or (want_reasoning and want_reasoning in content)):
        problems.append(f"{mode}: markup or reasoning left in content: {content!r}")
    return problems


def run_roundtrip(online_renderer, reasoning_parser: str | None, tool_parser: str | None,
                  auto_tools: bool, template: str | None = None) -> RoundtripResult:
    """Render, parse and compare on vLLM's own serving objects (see the module docstring);
    ``template`` names the chat template in messages (default: from the renderer)."""
    template = template or template_source(online_renderer.chat_template)
    result = dict(reasoning_parser=reasoning_parser, tool_parser=tool_parser, template=template)
    flags = []
    if reasoning_parser:
        flags.append(f"--reasoning-parser {reasoning_parser}")
    if tool_parser:
        flags.append(f"--tool-call-parser {tool_parser}")
    fix = ("serve Ling-3 with --enable-auto-tool-choice --tool-call-parser ling3 --reasoning-parser "
           "ling3 and the model's own chat template (vllm-ling serve does), or set VLLM_LING_VERIFY=warn")
    if not reasoning_parser and not tool_parser:
        return RoundtripResult(OFF, detail="no --reasoning-parser and no --tool-call-parser: reasoning stays in "
                               "content and tool calls come back as text", **result)
    if tool_parser and not auto_tools:
        return RoundtripResult(FAILED, detail=f"--tool-call-parser {tool_parser} without --enable-auto-tool-choice: "
                               "vLLM builds no tool parser, so tool calls come back as plain text", fix=fix, **result)
    parser_cls = online_renderer.parser
    if parser_cls is None:
        return RoundtripResult(FAILED, detail=f"vLLM built no parser for {' '.join(flags)}", fix=fix, **result)
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    tokenizer = online_renderer.renderer.get_tokenizer()
    model_config = online_renderer.model_config
    request = ChatCompletionRequest(model="vllm-ling-roundtrip", messages=PROMPT_MESSAGES, tools=[TOOL],
                                    tool_choice="auto")
    kwargs = online_renderer.effective_chat_template_kwargs(request)
    thinking = _thinking_on(kwargs)
    turn = {"role": "assistant", "content": "", "tool_calls": [{
        "id": "call_0", "type": "function",
        "function": {"name": TOOL["function"]["name"], "arguments": json.dumps(ARGUMENTS)}}]}
    if thinking:
        turn["reasoning"] = REASONING
    tool_dicts = [TOOL]
    try:
        prompt = _render(online_renderer, PROMPT_MESSAGES, tool_dicts, add_generation_prompt=True)
        full = _render(online_renderer, PROMPT_MESSAGES + [turn], tool_dicts, add_generation_prompt=False)
    except Exception as exc:  # noqa: BLE001 - any template failure is the finding
        return RoundtripResult(FAILED, detail=f"{template} cannot render a tool-call turn: {exc}", fix=fix, **result)
    if not full.startswith(prompt):
        return RoundtripResult(FAILED, detail=f"{template} renders the assistant turn differently from its "
                               "generation prompt, so generated text cannot be cut out of it", fix=fix, **result)
    ids = tokenizer.encode(full[len(prompt):], add_special_tokens=False)
    stops = _stop_ids(online_renderer, tokenizer)
    while ids and (ids[-1] in stops or not tokenizer.decode(ids[-1:]).strip()):
        ids.pop()  # vLLM stops at the end-of-turn token and never shows what the template adds after it
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    parser = parser_cls(tokenizer, request.tools, chat_template_kwargs=kwargs, model_config=model_config)
    request = parser.adjust_request(request)
    text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
    parser.set_prompt_token_ids(prompt_ids)
    want_reasoning = REASONING if (thinking and reasoning_parser) else None
    has_tools = parser_cls.tool_parser_cls is not None
    reasoning, content, calls = parser.parse(text, request, enable_auto_tools=auto_tools, model_output_token_ids=ids)
    problems = _compare("non-streamed", reasoning, content,
                        [{"name": c.name, "arguments": c.arguments} for c in calls or []], want_reasoning, has_tools)
    problems += _compare("streamed", *_stream(parser_cls, tokenizer, request, kwargs, model_config, ids, prompt_ids),
                         want_reasoning, has_tools)
    checked = " and ".join(x for x in (("reasoning" if want_reasoning else ""),
                                       ("tool call" if has_tools else "")) if x) or "nothing"
    if problems:
        return RoundtripResult(FAILED, detail=f"{' '.join(flags)} do not parse what {template} renders "
                               f"({len(text)} chars): " + "; ".join(problems), fix=fix, **result)
    return RoundtripResult(PASSED, detail=f"{' '.join(flags)} parse back the {checked} that {template} renders "
                           f"(thinking {'on' if thinking else 'off'}; streamed and not)", **result)


def record_in_report(result: RoundtripResult, path: str | None) -> bool:
    """Add the result to the startup report the workers wrote (its check row and its own
    section; a failure fails the report). False when there is no report to add to."""
    from vllm_ling.runtime.report import update_report

    def add(report: dict[str, Any]) -> None:
        report["checks"] = [c for c in report.get("checks", []) if c.get("name") != CHECK_NAME]
        report["checks"].append(result.as_check())
        report["chat_roundtrip"] = result.as_report()
        report["passed"] = all(c["passed"] for c in report["checks"])

    return update_report(path, add)


class ChatRoundtripRefusal(LingVerificationError):
    """A strict server's refusal of a failed round trip: one line, no traceback (vllm_ling.refusal)."""


def refusal_message(result: RoundtripResult) -> str:
    """What a strict server says for a failed round trip (here and in vllm_ling.cli.chat_precheck)."""
    return f"vllm-ling refuses to serve: chat round-trip check failed: {result.detail}. Fix: {result.fix}."


def check_at_startup(state, args) -> RoundtripResult | None:
    """The endpoint plugin's hook: run the check on vLLM's serving state, log and record it,
    and apply ``VLLM_LING_VERIFY`` (strict raises, so the server does not start)."""
    import logging

    from vllm_ling.log import get_logger, log_once
    from vllm_ling.options import LingOptions, VerifyPolicy

    logger = get_logger("chat_roundtrip")
    options = LingOptions.current()
    if options.verify is VerifyPolicy.OFF:
        log_once(logger, logging.WARNING, "roundtrip-off",
                 "Chat template / parser round-trip check is OFF (VLLM_LING_VERIFY=off).")
        return None
    online_renderer = getattr(state, "online_renderer", None)
    if online_renderer is None:
        logger.warning("chat round-trip check skipped: this server has no chat renderer")
        return None
    result = run_roundtrip(online_renderer, *parser_flags(args),
                           template=template_source(getattr(args, "chat_template", None)))
    recorded = record_in_report(result, options.report_path)
    where = "" if recorded else " (no startup report to record it in)"
    if result.status == PASSED:
        logger.info("chat round-trip check passed: %s%s", result.detail, where)
    elif result.status == OFF:
        logger.warning("chat round-trip check: %s (%s)%s", OFF, result.detail, where)
    elif options.verify is VerifyPolicy.STRICT:
        raise ChatRoundtripRefusal(refusal_message(result))
    else:
        logger.warning("chat round-trip check FAILED: %s. Fix: %s%s", result.detail, result.fix, where)
    return result
