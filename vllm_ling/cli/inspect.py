"""``vllm-ling inspect DIR``: what a Ling-3.0 checkpoint stores and what decoding reads.

Per tensor class: storage dtypes, tensor count, bytes on disk, and bytes read per
decoded token at batch 1 (routed experts: top_k of num_experts per MoE layer;
embeddings: one row; everything else in full). Reads safetensors headers only.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path

from vllm_ling.models.checkpoint_check import CheckpointFormatError, check_checkpoint, checkpoint_tensors
from vllm_ling.models.checkpoint_format import checkpoint_specs, stored_bytes, stored_tensors

_DTYPE_BYTES = {"bfloat16": 2, "float32": 4, "float16": 2, "float8_e4m3fn": 1, "uint8": 1,
                "float8_e8m0fnu": 1}


def summarize(model_dir: str | Path) -> dict:
    model_dir = Path(model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    found = checkpoint_tensors(model_dir)
    rows: dict[str, dict] = defaultdict(lambda: {"dtypes": set(), "tensors": 0, "bytes": 0,
                                                 "decode_bytes": 0.0})
    k, e = config["num_experts_per_tok"], config["num_experts"]
    for spec in checkpoint_specs(config, include_mtp=True):
        row = rows[spec.tensor_class]
        for name, _, dtype in stored_tensors(spec):
            if name in found:
                row["dtypes"].add(found[name][1])
        row["tensors"] += len(stored_tensors(spec))
        nbytes = stored_bytes(spec)
        row["bytes"] += nbytes
        if spec.tensor_class.endswith("routed_experts"):
            row["decode_bytes"] += nbytes * k / e
        elif spec.tensor_class == "embeddings":
            row["decode_bytes"] += nbytes / spec.shape[0]
        else:
            row["decode_bytes"] += nbytes
    out = {c: {**r, "dtypes": sorted(r["dtypes"])} for c, r in rows.items()}
    target = {c: r for c, r in out.items() if not c.startswith("mtp_")}
    return {
        "model_dir": str(model_dir),
        "classes": out,
        "total_bytes": sum(r["bytes"] for r in out.values()),
        "decode_bytes_per_token_target": sum(r["decode_bytes"] for r in target.values()),
        "decode_bytes_per_token_mtp": sum(r["decode_bytes"] for c, r in out.items() if c.startswith("mtp_")),
    }


def _fmt_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if abs(n) < 1000 or unit == "GB":
            return f"{n:,.1f} {unit}" if unit != "B" else f"{n:,.0f} B"
        n /= 1000
    return f"{n}"


def format_table(summary: dict) -> str:
    lines = [f"checkpoint: {summary['model_dir']}", "",
             "| tensor class | dtypes | tensors | bytes | read per decode token |",
             "|---|---|---|---|---|"]
    for cls, r in sorted(summary["classes"].items(), key=lambda kv: -kv[1]["bytes"]):
        lines.append(f"| {cls} | {', '.join(r['dtypes'])} | {r['tensors']} | {_fmt_bytes(r['bytes'])} "
                     f"| {_fmt_bytes(r['decode_bytes'])} |")
    lines += ["", f"total stored: {_fmt_bytes(summary['total_bytes'])}",
              f"read per decode token (target, batch 1): {_fmt_bytes(summary['decode_bytes_per_token_target'])}",
              f"read per draft token (NEXTN layer): {_fmt_bytes(summary['decode_bytes_per_token_mtp'])}"]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="vllm-ling inspect", description=__doc__.split("\n\n")[0])
    parser.add_argument("dir")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")
    args = parser.parse_args(argv)
    model_dir = Path(args.dir)
    if not (model_dir / "config.json").exists():
        print(f"vllm-ling inspect: {model_dir / 'config.json'} not found", flush=True)
        return 2
    try:
        check_checkpoint(model_dir, json.loads((model_dir / "config.json").read_text()), include_mtp=True)
    except CheckpointFormatError as exc:
        print(f"vllm-ling inspect: {exc}")
        return 1
    summary = summarize(model_dir)
    print(json.dumps(summary, indent=2) if args.json else format_table(summary))
    return 0
