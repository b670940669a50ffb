"""``vllm-ling make-tiny DIR``: write a deterministic tiny random-weight Ling-3.0 checkpoint
in the real ``-fp4`` storage format (see :mod:`vllm_ling.models.tiny_checkpoint`)."""

from __future__ import annotations

import argparse

from vllm_ling.models.tiny_checkpoint import TINY_CONFIG, make_tiny


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ling make-tiny", description=__doc__.split("\n")[0])
    parser.add_argument("dir", help="output directory (created)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--config", default=None,
                        help=f"config.json to start from (default: {TINY_CONFIG.name} shipped with vllm-ling)")
    parser.add_argument("--all-mla", action="store_true",
                        help="make every layer MLA (for vLLM-CPU MTP runs; see README)")
    parser.add_argument("--agreeing", action="store_true",
                        help="weights whose NEXTN layer provably predicts the target's next token")
    args = parser.parse_args(argv)
    out = make_tiny(args.dir, args.seed, args.config, args.all_mla, args.agreeing)
    print(f"wrote tiny Ling-3.0 checkpoint to {out}")
    return 0
