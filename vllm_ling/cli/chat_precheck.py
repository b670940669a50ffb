"""``python -m vllm_ling.cli.chat_precheck serve MODEL [vllm serve args]``: the chat round trip
before vLLM starts.

``vllm-ling serve`` runs it as a short-lived child when the chat template or a parser is not
vllm-ling's Ling-3 default and ``VLLM_LING_VERIFY=strict``, so a template and parsers that do
not agree are refused in seconds, before the engine starts and any weight loads (the API
server's own check, :func:`vllm_ling.runtime.chat_roundtrip.check_at_startup`, would refuse
them only after the weights loaded). It needs no engine: vLLM's serve parser reads the same
arguments, vLLM builds the config (vllm-ling's config hooks included), the renderer and the
parser classes as its API server does, and :func:`~vllm_ling.runtime.chat_roundtrip.run_roundtrip`
runs on them.

Exit 0: passed, off, or the check could not run (the server's own check still runs); exit
``EXIT_REFUSED`` with the refusal as the last stderr line: a failed round trip, or another
refusal met on the way (:class:`vllm_ling.refusal.Refusal`).
"""

from __future__ import annotations

import sys

EXIT_REFUSED = 2
REFUSAL_PREFIX = "vllm-ling: error: "


def _online_renderer(vllm_config, args):
    """vLLM's OnlineRenderer as its API server builds it from the serve flags (app_state.py)."""
    from vllm.entrypoints.launchers.cli_args import resolve_default_chat_template_kwargs
    from vllm.renderers import renderer_from_config
    from vllm.renderers.chat_utils import load_chat_template
    from vllm.renderers.online_renderer import OnlineRenderer

    return OnlineRenderer(
        model_config=vllm_config.model_config, renderer=renderer_from_config(vllm_config),
        request_logger=None, chat_template=load_chat_template(args.chat_template),
        chat_template_content_format=args.chat_template_content_format,
        enable_auto_tools=args.enable_auto_tool_choice, tool_parser=args.tool_call_parser,
        reasoning_parser=args.reasoning_parser or vllm_config.structured_outputs_config.reasoning_parser,
        default_chat_template_kwargs=resolve_default_chat_template_kwargs(args))


def check(argv: list[str]):
    """The round-trip result for the ``vllm serve`` arguments ``argv`` (``["serve", MODEL, ...]``)."""
    from vllm_ling.patches.registry import Stage, apply_all

    apply_all(Stage.VLLM_CLI)
    import vllm_ling
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from vllm_ling.runtime.chat_roundtrip import parser_flags, run_roundtrip, template_source

    vllm_ling.register()
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(argv)
    if getattr(args, "model_tag", None):  # as vLLM's serve command does with the positional MODEL
        args.model = args.model_tag
    vllm_config = AsyncEngineArgs.from_cli_args(args).create_engine_config()
    reasoning, tool, auto = parser_flags(args)
    reasoning = reasoning or vllm_config.structured_outputs_config.reasoning_parser
    return run_roundtrip(_online_renderer(vllm_config, args), reasoning, tool, auto,
                         template=template_source(args.chat_template))


def main(argv: list[str] | None = None) -> int:
    from vllm_ling.refusal import find
    from vllm_ling.runtime.chat_roundtrip import FAILED, refusal_message

    try:
        result = check(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as exc:  # vLLM's parser: its own message is above
        return int(exc.code or 0) and EXIT_REFUSED
    except Exception as exc:  # noqa: BLE001 - a refusal is the answer; anything else is not ours to block on
        refusal = find(exc)
        if refusal is None:
            detail = " ".join(str(exc).split())  # one line: the launcher shows the last one
            print(f"chat round-trip check could not run before the start: {type(exc).__name__}: {detail}",
                  file=sys.stderr, flush=True)
            return 0
        print(REFUSAL_PREFIX + str(refusal), file=sys.stderr, flush=True)
        return EXIT_REFUSED
    if result.status == FAILED:
        print(REFUSAL_PREFIX + refusal_message(result), file=sys.stderr, flush=True)
        return EXIT_REFUSED
    print(f"chat round-trip check {result.status}: {result.detail}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
