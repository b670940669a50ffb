"""Ling-3 is served as an agent model: ``vllm-ling serve`` turns on its parsers by default.

Every published way to serve Ling-3.0-flash (vLLM's recipe, inclusionAI's DGX Spark notebook,
SGLang's cookbook) runs ``--enable-auto-tool-choice --tool-call-parser ling3
--reasoning-parser ling3``; without them a client's tool calls come back as plain text and the
reasoning lands in ``content``, silently. This module turns the two settings
(``--tool-call-parser`` / ``VLLM_LING_TOOL_CALL_PARSER``, ``--reasoning-parser`` /
``VLLM_LING_REASONING_PARSER``; ``none`` turns one off) and the vLLM flags the user passed
through into the ``vllm serve`` flags, with one note per override. A parser flag given to vLLM
directly (after ``--``) wins: vllm-ling then adds nothing for it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from vllm_ling.options import LING3_PARSER as LING_PARSER
OFF_VALUES = ("none", "off")
AUTO_TOOL_FLAG = "--enable-auto-tool-choice"
# option name -> the vllm serve flag it becomes
PARSER_FLAGS = {"tool_call_parser": "--tool-call-parser", "reasoning_parser": "--reasoning-parser"}
# What the defaults add: vLLM's recipe for Ling-3.0-flash.
LING_PARSER_ARGS = (AUTO_TOOL_FLAG, PARSER_FLAGS["tool_call_parser"], LING_PARSER,
                    PARSER_FLAGS["reasoning_parser"], LING_PARSER)


def _given(passthrough: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in passthrough)


def parser_args(values: Mapping[str, str | None], sources: Mapping[str, str],
                passthrough: Sequence[str]) -> tuple[list[str], list[str]]:
    """(``vllm serve`` flags, notes). ``values`` holds the resolved settings, ``sources`` names
    where a setting that is not the default came from (flag or environment variable)."""
    args: list[str] = []
    notes: list[str] = []
    tool_on = False
    for name, flag in PARSER_FLAGS.items():
        value = (values.get(name) or LING_PARSER).strip()
        if _given(passthrough, flag):
            notes.append(f"{flag} passed to vllm serve as given (overrides the Ling default {LING_PARSER}).")
            tool_on |= name == "tool_call_parser"
            continue
        if value.lower() in OFF_VALUES:
            notes.append(f"{flag} off by request ({sources.get(name, flag)}={value}): "
                         + ("tool calls come back as plain text." if name == "tool_call_parser"
                            else "reasoning stays in the message content."))
            continue
        if value != LING_PARSER:
            notes.append(f"{flag} {value} (from {sources.get(name, flag)}) overrides the Ling default {LING_PARSER}.")
        args += [flag, value]
        tool_on |= name == "tool_call_parser"
    if tool_on and not _given(passthrough, AUTO_TOOL_FLAG):
        # vLLM builds no tool parser for tool_choice "auto" without it.
        args.append(AUTO_TOOL_FLAG)
    return args, notes
