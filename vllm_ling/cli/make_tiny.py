"""``vllm-ling make-tiny DIR``: write a deterministic tiny random-weight Ling-3.0 checkpoint
in the real ``-fp4`` storage format (see :mod:`vllm_ling.models.tiny_checkpoint`).

Without ``--agreeing`` or ``--script`` the weights are random: it serves, but its NEXTN draft is
never accepted (the smoke check notes it); the other two make drafts that are (README, "The tiny
checkpoint")."""

from __future__ import annotations

import argparse
from pathlib import Path

from vllm_ling.models.tiny_checkpoint import TINY_CONFIG, make_tiny


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ling make-tiny", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=None,
                        help=f"config.json to start from (default: {TINY_CONFIG.name} shipped with vllm-ling)")
    parser.add_argument("--all-mla", action="store_true",
                        help="make every layer MLA (no KDA layers; some tests and the compose CPU demo use it)")
    parser.add_argument("--routable", action="store_true",
                        help="64 routed experts in 2 groups of 32 (the tiny default has 16 in 4): the router top-k "
                             "kernel serves it, as it does the full size")
    weights = parser.add_mutually_exclusive_group()  # two ways of choosing the weights
    weights.add_argument("--agreeing", action="store_true",
                         help="weights whose NEXTN layer provably predicts the target's next token")
    weights.add_argument("--script", default=None, metavar="TEXT_OR_FILE",
                         help="weights whose greedy answer to any chat prompt is this text (or the "
                              "contents of this file), e.g. reasoning, </think>, then a <tool_call>; "
                              "the NEXTN draft predicts every token of it")
    parser.add_argument("--dspark", default=None, metavar="DRAFT_DIR",
                        help="also write a tiny DSpark drafter for it in DRAFT_DIR (the real drafter's format; "
                             "with --agreeing or --script, one whose every draft the target accepts)")
    args = parser.parse_args(argv)
    script = args.script
    if script is not None and Path(script).is_file():
        script = Path(script).read_text().rstrip("\n")
    try:
        out = make_tiny(args.dir, args.seed, args.config, args.all_mla, args.agreeing, script, args.routable)
    except ValueError as exc:
        parser.error(f"--script: {exc}")
    kind = ("scripted: its greedy chat answer is the script" if script is not None
            else "agreeing: its NEXTN draft predicts every token" if args.agreeing
            else "random weights: its NEXTN draft is never accepted (--agreeing or --script for one that is)")
    print(f"wrote tiny Ling-3.0 checkpoint to {out} ({kind})")
    if args.dspark is not None:
        from vllm_ling.models.tiny_dspark import make_tiny_dspark

        draft = make_tiny_dspark(args.dspark, out, args.seed, agreeing=args.agreeing or script is not None)
        print(f"wrote tiny DSpark drafter for it to {draft}")
    return 0
