"""``vllm-ling plan``: predict decode traffic, floor TPOT and MTP speedup from a config alone.

The numbers come from :mod:`vllm_ling.models.cost_model`; this module is the command line
and the text report. Imports neither vLLM nor torch.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from vllm_ling.models.cost_model import (DEVICE_BANDWIDTH_GBS, GB, HEAD_BYTES_PER_PARAM, MB, STUDY_SPARK,
                                         PlanError, build_plan, dspark_draft_components, dspark_model,
                                         load_config, mtp_speedup, plan_to_dict, totals)
from vllm_ling.models.measured_efficiency import EfficiencyFileError, load_decode_step


def _study_comparison(result: dict[str, Any]) -> list[str]:
    """Where the bytes model and the study's DGX Spark measurements agree and disagree."""
    lines: list[str] = []
    bw = result["bandwidth_gbs"]
    h = result["heads"]
    s = STUDY_SPARK
    lines.append(f"Model vs the study's DGX Spark measurements (context {s['context']}; "
                 f"floors at {bw:g} GB/s):")
    rows = [
        ("baseline (fp32 head)", h["fp32"]["floor_tpot_ms"], s["baseline_tpot_ms"]),
        ("+ humming MoE (fp32 head)", h["fp32"]["floor_tpot_ms"], s["humming_tpot_ms"]),
        ("+ FP8 head", h["fp8"]["floor_tpot_ms"], s["fp8_head_tpot_ms"]),
    ]
    lines.append(f"  {'configuration':28s} {'floor ms':>9s} {'measured ms':>12s} {'floor/measured':>15s}")
    for name, floor, meas in rows:
        lines.append(f"  {name:28s} {floor:9.2f} {meas:12.2f} {floor / meas:15.1%}")
    pred_fp32 = h["fp32"]["floor_tpot_ms"] - h["fp8"]["floor_tpot_ms"]
    pred_bf16 = h["bf16"]["floor_tpot_ms"] - h["fp8"]["floor_tpot_ms"]
    meas = s["humming_tpot_ms"] - s["fp8_head_tpot_ms"]
    lines.append(
        f"  FP8 head saves {meas:.2f} ms measured ({meas / s['humming_tpot_ms']:.1%} of TPOT, "
        f"{s['humming_tpot_ms'] / s['fp8_head_tpot_ms'] - 1:+.1%} tok/s); the floor model predicts "
        f"{pred_fp32:.2f} ms from an fp32 head and {pred_bf16:.2f} ms from a BF16 head: the measurement "
        "lies between the two (the published numbers do not say which bytes the baseline head read).")
    lines.append(
        "  Humming vs FlashInfer MoE reads the same bytes, so the model predicts no change; the "
        f"measured {s['baseline_tpot_ms'] / s['humming_tpot_ms'] - 1:+.1%} tok/s is kernel efficiency: "
        "a batch-1 MoE layer is latency-bound (H200 measurements: benchmarks/results/moe_h200.md).")
    m = h["fp8"]["mtp"]
    pred = mtp_speedup(s["mtp_accept_length"], m["verify_cost_ratio"], m["draft_cost_ratio"])
    meas_speedup = s["fp8_head_tpot_ms"] / s["mtp_tpot_ms"]
    implied_cycle = s["mtp_accept_length"] / meas_speedup
    lines.append(
        f"  MTP at accept length {s['mtp_accept_length']}: model speedup {pred:.2f}x "
        f"(verify {m['verify_cost_ratio']:.2f} + draft {m['draft_cost_ratio']:.2f} steps), measured "
        f"{meas_speedup:.2f}x, i.e. a measured cycle of {implied_cycle:.2f} plain steps: uniform "
        "routing is the worst case for the verify window (consecutive tokens share experts, so fewer "
        "than the modelled distinct experts are read), and a 4-token step uses bandwidth better "
        "than a 1-token step.")
    gsm = s["gsm8k_accept_length"]
    lines.append(
        f"  At GSM8K's accept length {gsm} the same model gives "
        f"{mtp_speedup(gsm, m['verify_cost_ratio'], m['draft_cost_ratio']):.2f}x: synthetic greedy "
        f"prompts ({s['mtp_accept_length']}) overstate what MTP gives on real text.")
    lines.append(
        "  Floors are lower bounds: achieved bandwidth fractions below 100% are expected "
        "(kernel launch gaps, latency-bound small GEMMs, sampling, scheduling). The byte model "
        "ignores compute and launch latency, so it understates small latency-bound steps (draft "
        "steps, batch-1 MoE layers) more than large ones.")
    return lines


def format_plan(result: dict[str, Any], head: str) -> str:
    out: list[str] = []
    L = result["layers"]
    out.append(f"vllm-ling plan: {result['config']}")
    out.append(f"  {L['total']} layers ({L['kda']} KDA + {L['mla']} MLA; {L['dense_mlp']} dense MLP + "
               f"{L['moe']} MoE); context {result['context_tokens']} tokens; verify window "
               f"{result['verify_tokens']} tokens ({result['distinct_experts_per_layer_verify']:.1f} "
               "distinct experts/layer under uniform routing)")
    out.append(f"  device: {result['device']} at {result['bandwidth_gbs']:g} GB/s")
    out.append("")
    k = result["verify_tokens"]
    out.append(f"  {'bytes per decode step (reads + state writes)':44s} {'batch 1 MB':>11s} {f'verify k={k} MB':>15s}")
    for c in result["components"]:
        out.append(f"  {c['name']:44s} {c['batch1_bytes'] / MB:11.1f} {c['verify_bytes'] / MB:15.1f}")
    hd = result["heads"][head]
    out.append(f"  {'LM head ' + head + ' (embeddings excluded: a gather)':44s} "
               f"{hd['head_bytes'] / MB:11.1f} {hd['head_bytes'] / MB:15.1f}")
    out.append(f"  {'total':44s} {hd['bytes_per_token_batch1'] / MB:11.1f} "
               f"{hd['bytes_per_verify_step'] / MB:15.1f}")
    out.append("")
    out.append(f"  {'head':6s} {'GB/token':>9s} {'floor TPOT ms':>14s} {'ceiling tok/s':>14s} "
               f"{'tok/s vs fp32':>14s} {'verify ratio':>13s} {'draft ratio':>12s} {'break-even AL':>14s}")
    base = result["heads"]["fp32"]["floor_tpot_ms"]
    for name in ("fp32", "bf16", "fp8"):
        x = result["heads"][name]
        m = x["mtp"]
        out.append(f"  {name:6s} {x['bytes_per_token_batch1'] / GB:9.3f} {x['floor_tpot_ms']:14.2f} "
                   f"{x['ceiling_tokens_per_s']:14.1f} {base / x['floor_tpot_ms'] - 1:+14.1%} "
                   f"{m['verify_cost_ratio']:13.2f} {m['draft_cost_ratio']:12.2f} "
                   f"{m['break_even_accept_length']:14.2f}")
    out.append("")
    m = hd["mtp"]
    out.append(f"  MTP speedup = accept_length / (verify_cost_ratio + draft_cost_ratio), "
               f"{result['draft_tokens']} draft tokens, {head} head, time proportional to bytes:")
    ratios = [("model", m["verify_cost_ratio"])]
    if "verify_cost_ratio_given" in m:
        ratios.append(("given", m["verify_cost_ratio_given"]))
    als = [a / 2 for a in range(2, 2 * (result["draft_tokens"] + 1) + 1)]
    out.append("  " + f"{'accept length':>22s} " + " ".join(f"{a:6.2f}" for a in als))
    for label, vr in ratios:
        sp = [mtp_speedup(a, vr, m["draft_cost_ratio"]) for a in als]
        out.append("  " + f"{f'verify {vr:.2f} ({label})':>22s} " + " ".join(f"{x:5.2f}x" for x in sp))
    return "\n".join(out)


# Published DSpark accept lengths for Ling-3.0-flash (docs/dspark.md): the model card's macro mean and
# its GSM8K figure, SGLang's B200 cookbook run, and the H200 target point.
PUBLISHED_DSPARK_ACCEPT = {"target point": 4.0, "model card, 9-workload mean": 5.29,
                           "SGLang B200 cookbook": 6.22, "model card, GSM8K": 6.40}
DSPARK_CONFIG = "ling3_flash_dspark_config.json"


def load_dspark_fields(path: str | None):
    """The drafter's fields from a drafter directory or config.json (default: the packaged full-size one)."""
    from importlib import resources

    from vllm_ling.models.dspark_format import DSparkFormatError, read_fields

    if path is None:
        ref = resources.files("vllm_ling") / "data" / DSPARK_CONFIG
        return read_fields(json.loads(ref.read_text()), f"packaged {DSPARK_CONFIG}")
    file = Path(path) / "config.json" if Path(path).is_dir() else Path(path)
    if not file.is_file():
        raise PlanError(f"--dspark-config {path!r}: no such file or drafter directory")
    try:
        return read_fields(json.loads(file.read_text()), str(file))
    except (DSparkFormatError, json.JSONDecodeError) as exc:
        raise PlanError(str(exc)) from None


def kv_section(cfg: dict, context: int, draft_tokens: int, dspark: tuple[Any, int] | None) -> tuple[list[str], dict]:
    """KV cache and KDA state one request of ``context`` tokens takes on CUDA, in vLLM's page layout
    (the memory guard's :func:`~vllm_ling.launcher.memory_guard.cuda_kv_and_state_bytes`): what sizes
    ``--max-num-seqs`` at a given KV budget, per speculation mode."""
    from vllm_ling.launcher.memory_guard import cuda_kv_and_state_bytes

    def need(mtp: bool, tokens: int, drafter=None) -> int:
        return cuda_kv_and_state_bytes(cfg, max_model_len=context, max_num_seqs=1, mtp=mtp, tensor_parallel_size=1,
                                       spec_tokens=tokens, drafter=drafter)

    rows = {"no speculation": need(False, 0)}
    if draft_tokens:
        rows[f"MTP x {draft_tokens}"] = need(True, draft_tokens)
    if dspark is not None:
        rows[f"DSpark x {dspark[1]}"] = need(True, dspark[1], dspark[0])
    lines = [f"  KV cache + KDA state per {context}-token request on CUDA (vLLM's pages, TP 1): "
             + ", ".join(f"{name} {b / GB:.2f} GB" for name, b in rows.items())]
    return lines, rows


def dspark_section(cfg: dict, fields, context: int, draft_tokens: int, head: str, bandwidth_gbs: float,
                   mtp_result: dict) -> tuple[list[str], dict]:
    """The DSpark cycle next to NEXTN MTP's: draft bytes, verify window, break-even and TPOT at the
    published accept lengths (time proportional to bytes, as for MTP)."""
    plan = build_plan(cfg, context=context, verify_tokens=draft_tokens + 1)
    m = dspark_model(plan, head, fields, draft_tokens)
    floor_ms = totals(plan, head)[0] / (bandwidth_gbs * GB) * 1e3
    mtp = mtp_result["heads"][head]["mtp"]
    cycle, mtp_cycle = m["break_even_accept_length"], mtp["break_even_accept_length"]
    lines = [f"DSpark drafter ({fields.source}): {fields.num_layers} layers, block {fields.block_size}, "
             f"{draft_tokens} draft tokens, verify window {draft_tokens + 1} tokens "
             f"({plan.distinct_experts_verify:.1f} distinct experts/layer), {head} head shared",
             f"  {'bytes per draft cycle':44s} {'MB':>11s}"]
    for c in dspark_draft_components(fields, context, draft_tokens):
        lines.append(f"  {c.name:44s} {c.batch1_bytes / MB:11.1f}")
    lines.append(f"  {'shared LM head ' + head + ' (once for the block)':44s} {plan.head_bytes[head] / MB:11.1f}")
    lines.append(f"  verify {m['verify_cost_ratio']:.2f} + draft {m['draft_cost_ratio']:.2f} plain steps = "
                 f"break-even accept length {cycle:.2f} (NEXTN MTP x{mtp_result['draft_tokens']}: {mtp_cycle:.2f})")
    lines.append(f"  TPOT = floor {floor_ms:.2f} ms x cycle / accept length:")
    rows = {}
    for label, accept in PUBLISHED_DSPARK_ACCEPT.items():
        tpot = floor_ms * cycle / accept
        rows[label] = {"accept_length": accept, "tpot_ms": tpot, "tokens_per_s": 1e3 / tpot}
        lines.append(f"    {label:30s} accept {accept:4.2f}: {tpot:6.2f} ms ({1e3 / tpot:6.1f} tok/s)")
    gsm = STUDY_SPARK["gsm8k_accept_length"]
    lines.append(f"    {'NEXTN MTP at GSM8K (study)':30s} accept {gsm:4.2f}: {floor_ms * mtp_cycle / gsm:6.2f} ms")
    return lines, {**m, "draft_tokens": draft_tokens, "floor_tpot_ms": floor_ms, "published": rows,
                   "verify_step_bytes": totals(plan, head)[1]}


def _measured_lines(path: str, composition: str, result: dict, head: str) -> tuple[list[str], list[dict]]:
    """Predicted step times from a decode_step run, with where they came from, two ways: the run's
    fraction of the copy bandwidth, and the floor plus the run's launches at its per-launch cost
    (closer on a slower memory system, where the bytes grow and the launch cost does not). The
    1-token step and the verify window each use the run's numbers for the same token count."""
    h = result["heads"][head]
    lines, out = [f"measured efficiency ({composition} composition, file {path}):"], []
    for tokens, nbytes, label in ((1, h["bytes_per_token_batch1"], "1-token step"),
                                  (result["verify_tokens"], h["bytes_per_verify_step"],
                                   f"{result['verify_tokens']}-token verify step")):
        eff = load_decode_step(path, tokens=tokens, composition=composition)
        floor_ms = nbytes / (result["bandwidth_gbs"] * GB) * 1e3
        predicted_ms = eff.predict_us(nbytes, result["bandwidth_gbs"]) / 1e3
        with_launches = eff.predict_with_launches_us(nbytes, result["bandwidth_gbs"])
        lines.append(f"  {label}: floor {floor_ms:.2f} ms -> {predicted_ms:.2f} ms at the measured "
                     f"{eff.step_fraction:.2f} of bandwidth ({eff.device}; copy {eff.copy_gbs:.0f} GB/s)")
        entry = {"tokens": tokens, "floor_ms": floor_ms, "predicted_ms": predicted_ms,
                 "efficiency": eff.step_fraction, "source": eff.source, "device": eff.device}
        if with_launches is not None:
            lines.append(f"    or floor + {eff.launches} launches x {eff.launch_overhead_us:.2f} us (that run's time "
                         f"above its bytes, per launch): {with_launches / 1e3:.2f} ms")
            entry.update(launches=eff.launches, launch_overhead_us=eff.launch_overhead_us,
                         predicted_with_launches_ms=with_launches / 1e3)
        out.append(entry)
    return lines, out


def build_arg_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="vllm-ling plan",
        description="Bytes read per decode token by component, floor TPOT at a device's bandwidth, "
                    "and the expected MTP speedup, from a Ling-3.0 config alone.")
    p.add_argument("checkpoint", nargs="?", help="checkpoint directory containing config.json")
    p.add_argument("--config", help="config.json path (default: packaged full-size Ling-3.0-flash-fp4)")
    p.add_argument("--device", default="spark", choices=sorted(DEVICE_BANDWIDTH_GBS),
                   help="bandwidth preset (default spark = DGX Spark 273 GB/s)")
    p.add_argument("--bandwidth-gbs", type=float, help="device bandwidth in GB/s (overrides --device)")
    p.add_argument("--context", type=int, default=32768, help="context length for KV cache reads")
    p.add_argument("--draft-tokens", type=int, default=3,
                   help="MTP draft tokens per cycle; the verify window is this + 1 (default 3)")
    p.add_argument("--dspark-tokens", type=int, default=None,
                   help="DSpark draft tokens (default: the drafter's block_size; at most it)")
    p.add_argument("--head", default="fp8", choices=sorted(HEAD_BYTES_PER_PARAM),
                   help="LM head dtype for the component table (default fp8)")
    p.add_argument("--verify-cost-ratio", type=float,
                   help="a measured verify cost (in plain decode steps) to tabulate next to the model's")
    p.add_argument("--efficiency", metavar="DECODE_STEP_JSON",
                   help="a `python -m benchmarks.decode_step --json` result: also predict step times at the "
                        "efficiency that run measured (e.g. benchmarks/results/decode_step_h200.json)")
    p.add_argument("--efficiency-composition", default="ours", choices=("ours", "upstream"),
                   help="which composition of that run to take the efficiency from (default ours)")
    p.add_argument("--drafter", default="mtp", choices=("mtp", "dspark"),
                   help="dspark: also model the DSpark drafter's cycle (draft tokens default to its block_size)")
    p.add_argument("--dspark-config", metavar="PATH",
                   help="the DSpark drafter's directory or config.json (default: packaged full-size Ling-3.0-flash-dspark)")
    p.add_argument("--json", help="write the full plan as JSON to this path")
    p.add_argument("--no-study", action="store_true", help="do not print the comparison with the study")
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_arg_parser()
    args = parser.parse_args(argv)
    if args.bandwidth_gbs is not None and args.bandwidth_gbs <= 0:
        parser.error("--bandwidth-gbs must be > 0")
    if args.draft_tokens < 0:
        parser.error("--draft-tokens must be >= 0")
    if args.dspark_tokens is not None and args.dspark_tokens < 1:
        parser.error("--dspark-tokens must be >= 1")
    try:
        cfg, path = load_config(args.checkpoint, args.config)
        plan = build_plan(cfg, context=args.context, verify_tokens=args.draft_tokens + 1, config_path=path)
    except PlanError as exc:
        print(f"vllm-ling plan: error: {exc}", file=sys.stderr)
        return 2
    if args.bandwidth_gbs is not None:
        bw, device = args.bandwidth_gbs, f"custom ({args.bandwidth_gbs:g} GB/s)"
    else:
        bw, desc = DEVICE_BANDWIDTH_GBS[args.device]
        device = f"{args.device}: {desc}"
    result = plan_to_dict(plan, bw, device, args.draft_tokens, args.verify_cost_ratio)
    text = format_plan(result, args.head)
    if args.efficiency:
        try:
            lines, measured = _measured_lines(args.efficiency, args.efficiency_composition, result, args.head)
        except EfficiencyFileError as exc:
            print(f"vllm-ling plan: error: --efficiency {exc}", file=sys.stderr)
            return 2
        text += "\n\n" + "\n".join(lines)
        result["measured_efficiency"] = measured
    study_lines: list[str] = []
    full_size = cfg.get("num_experts") == 512 and cfg.get("hidden_size") == 2560
    same_setup = args.context == STUDY_SPARK["context"] and args.draft_tokens == 3
    if not args.no_study and full_size and same_setup and bw == DEVICE_BANDWIDTH_GBS["spark"][0]:
        study_lines = _study_comparison(result)
        result["study_comparison"] = study_lines
    if args.drafter == "dspark":
        try:
            fields = load_dspark_fields(args.dspark_config)
            if (args.dspark_tokens or 0) > fields.block_size:
                raise PlanError(f"--dspark-tokens {args.dspark_tokens} > the drafter's block_size {fields.block_size}")
            lines, result["dspark"] = dspark_section(cfg, fields, args.context, args.dspark_tokens or fields.block_size,
                                                     args.head, bw, result)
        except PlanError as exc:
            print(f"vllm-ling plan: error: {exc}", file=sys.stderr)
            return 2
        text += "\n\n" + "\n".join(lines)
    dspark = (fields, args.dspark_tokens or fields.block_size) if args.drafter == "dspark" else None
    kv_lines, result["kv_bytes_per_request_cuda"] = kv_section(cfg, args.context, args.draft_tokens, dspark)
    text += "\n\n" + "\n".join(kv_lines)
    print(text)
    if study_lines:
        print()
        print("\n".join(study_lines))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
