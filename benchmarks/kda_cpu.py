"""The plain-PyTorch KDA of vllm_ling.ops.kda on the CPU, at the tiny Ling config's KDA shape
(16 heads, head_dim 64) by default.

Rows: chunked prefill at several chunk sizes and the token-by-token recurrence (the
baseline, measured in the same run) for one long sequence; one decode step for a batch of
sequences (the state pool read and written in place). For each: median time, bytes moved
(q, k, v, g, beta read in float32, output written, recurrent state read and written), the
fraction of the host copy bandwidth measured in the same run (one large ``clone``, read +
write bytes), and the speed-up over the recurrent baseline. Prints a Markdown table and
writes it to --out.

    python -m benchmarks.kda_cpu                       # 2,048-token prefill, decode batch 8
    python -m benchmarks.kda_cpu --tokens 512 --heads 32 --head-dim 128
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import time

import torch

from vllm_ling.ops import kda


def median_s(fn, repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def copy_bandwidth(nbytes: int = 256 << 20) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).random_()
    t = median_s(lambda: src.clone(), 5)
    return 2 * nbytes / t  # read + write


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--decode-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results", "kda_cpu.md"))
    args = ap.parse_args(argv)
    T, H, D = args.tokens, args.heads, args.head_dim
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(T, H, D, generator=gen) for _ in range(3))
    g = kda.kda_gate(torch.randn(T, H * D, generator=gen), torch.randn(H, generator=gen),
                     torch.randn(H * D, generator=gen), lower_bound=-5.0)
    beta = torch.rand(T, H, generator=gen)
    state = torch.zeros(1, H, D, D)
    cu = torch.tensor([0, T])
    scale = D ** -0.5
    state_bytes = H * D * D * 4
    prefill_bytes = T * H * (4 * D * 4 + 4) + T * H * D * 4 + 2 * state_bytes
    bw = copy_bandwidth()

    rows = []
    t_base = median_s(lambda: kda.kda_recurrent(q, k, v, g, beta, state, cu, scale), args.repeats)
    rows.append((f"prefill {T} tok, recurrent (baseline)", t_base, prefill_bytes, 1.0))
    for cs in (16, 32, 64):
        t = median_s(lambda: kda.kda_chunked(q, k, v, g, beta, state, cu, scale, chunk_size=cs),
                     args.repeats)
        rows.append((f"prefill {T} tok, chunked C={cs}", t, prefill_bytes, t_base / t))

    B = args.decode_batch
    pool = torch.zeros(B + 1, H, D, D)
    slots = torch.arange(1, B + 1)
    dq, dk, dv, dg, db = q[:B], k[:B], v[:B], g[:B], beta[:B]
    dcu = torch.arange(B + 1)
    decode_bytes = B * (2 * state_bytes + H * (4 * D * 4 + 4) + H * D * 4)
    t_dec = median_s(lambda: kda.kda_decode_pooled(dq, dk, dv, dg, db, pool, dcu, slots, scale),
                     args.repeats * 5)
    rows.append((f"decode step, batch {B} (pooled state)", t_dec, decode_bytes, None))

    lines = [
        f"KDA plain PyTorch on CPU ({torch.get_num_threads()} threads, torch {torch.__version__}),"
        f" heads {H}, head_dim {D}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M}"
        f" UTC; host copy bandwidth {bw / 1e9:.1f} GB/s (read + write)",
        "",
        "| case | median ms | MB moved | fraction of copy bandwidth | speed-up vs recurrent |",
        "|---|---|---|---|---|",
    ]
    for name, t, nbytes, speedup in rows:
        sp = "-" if speedup is None else f"{speedup:.2f}x"
        lines.append(f"| {name} | {t * 1e3:.2f} | {nbytes / 1e6:.2f} | {nbytes / t / bw:.4f} | {sp} |")
    text = "\n".join(lines)
    print(text)
    with open(args.out, "w") as f:
        f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
