"""Weight-only FP8 (W8A16) linear for block-scaled e4m3 weights: one Triton kernel.

``out[m, n] = sum_k x[m, k] * w[n, k] * scale[n // 128, k // 128]`` with BF16 activations,
e4m3 weights, fp32 block scales (128 x 128, UE8M0 or any fp32), fp32 accumulation and a BF16
output. No activation quantization: at decode sizes the weights are the bytes, and skipping
the per-token-group quant kernel saves a launch and its error.

Why this shape of kernel (decode, 1..32 rows): the time is the weight bytes over the memory
bandwidth plus latency, so the kernel is built to keep the memory system busy:

- each program owns ``BLOCK_N`` output rows (8..128, a divisor of 128, so a program's rows share
  one scale row and the scale of a 128-wide k-step is one scalar) and walks all of K in steps of
  ``K_STEPS`` x 128 bytes per row; small ``BLOCK_N`` gives enough programs to fill every SM at
  one row (N=2560 -> 320 programs at BLOCK_N=8);
- ``PREFETCH_L2`` (sm_90+): before anything else a program asks the bulk-copy engine to pull
  its whole weight slab into L2 (``cp.async.bulk.prefetch.L2``, no registers held), so the
  DRAM reads are all in flight at once and the loop's loads hit L2;
- ``USE_PDL`` (sm_90+, programmatic dependent launch): the program lets the next kernel launch
  at once and waits for the previous kernel only before it reads ``x`` (weights and scales are
  constants), so its weight prefetch overlaps the previous kernel's tail;
- 1, 2 or 4 rows (``USE_DOT=False``): fp32 multiply-adds on a [BLOCK_N, K_STEPS x 128] tile
  reduced over k each step into a [BLOCK_N] accumulator per row, so the bytes in flight per
  thread (up to 256) do not cost accumulator registers; on the H200 this wins at one row, while
  2 and 4 rows (about 7 and 13 SASS instructions per weight byte) lose to the tensor cores;
  more rows (``USE_DOT=True``): e4m3 -> BF16 (exact) weights on the tensor cores, rows padded
  to ``BLOCK_M`` >= 16 (the e4m3 -> BF16 conversion goes through the F2F unit, about one
  instruction per weight byte; converting by bit moves doubled the instruction count in SASS);
  ``DOT_F16`` uses FP16 tensor cores instead (e4m3 -> fp16 is one cvt per two weights) on
  activations scaled per row by a power of two.

Where the time goes (SASS read with cuobjdump, H200 timings in benchmarks/results/): every path
spends 3.3-4.5 instructions per weight byte on address math, conversion and FMAs, which at the
issue rate the SMs reach leaves the kernel near 0.3-0.45 of the copy bandwidth; PDL saves ~1-2.5
us per launch, the L2 prefetch helps some shapes and hurts others (tuned per shape).

Numerics: every product ``w * x`` is exact in fp32 (4- and 8-bit mantissas); a power-of-two
scale keeps it exact; only the fp32 summation order and the final BF16 rounding differ from
the plain-PyTorch reference (``reference.py``), except on the FP16 tensor-core path (``DOT_F16``),
where activations below 2**-14 of their row's scaled range round as fp16 subnormals. No vLLM
import; Triton is optional (``None`` without it).
"""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # CPU-only installs
    triton = None
    tl = None


def triton_features() -> dict[str, bool]:
    """What the installed Triton offers for the levers above (empty dict without Triton)."""
    if triton is None:
        return {}
    gdc = getattr(getattr(getattr(tl, "extra", None), "cuda", None), "gdc_wait", None) is not None
    try:
        from triton.backends.nvidia.compiler import CUDAOptions

        launch_pdl = "launch_pdl" in CUDAOptions.__dataclass_fields__
    except Exception:  # noqa: BLE001 - another backend layout: no PDL
        launch_pdl = False
    return {"pdl": gdc and launch_pdl, "inline_asm": hasattr(tl, "inline_asm_elementwise")}


if triton is not None:

    @triton.jit
    def _prefetch_rows_l2(w_ptr, rows_n, stride_wn, BLOCK_N: tl.constexpr, PIECES: tl.constexpr,
                          PIECE_BYTES: tl.constexpr):
        # [BLOCK_N, PIECES] bulk prefetches of PIECE_BYTES each cover the program's rows.
        piece = tl.arange(0, PIECES)
        addr = (w_ptr + rows_n[:, None] * stride_wn + piece[None, :] * PIECE_BYTES).to(tl.int64)
        nbytes = tl.full([BLOCK_N, PIECES], PIECE_BYTES, tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2;\n\tmov.u32 $0, 0;",
            "=r,l,r", [addr, nbytes], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _row_dot(acc, w, x_row_ptrs, sc):
        # acc[n] += sum_k w[n, k] * (x[k] * scale[k]): x and the scales come in the weight
        # tile's layout (broadcast over rows, L1 hits), the tile is reduced over k at once, so
        # the accumulator stays [BLOCK_N] however many bytes a tile holds.
        return acc + tl.sum(w * (tl.load(x_row_ptrs).to(tl.float32) * sc), axis=1)

    @triton.jit
    def _store_row(out_ptr, ws_ptr, row, res, offs_n, mask_n, N, M, pid_k, SPLIT_K: tl.constexpr):
        mask = mask_n & ((offs_n * 0 + row) < M)
        if SPLIT_K == 1:
            tl.store(out_ptr + row * N + offs_n, res.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            tl.store(ws_ptr + (pid_k * M + row) * N + offs_n, res, mask=mask)

    @triton.jit
    def _w8a16_block_fp8_kernel(
        x_ptr, w_ptr, s_ptr, out_ptr, ws_ptr, cnt_ptr,
        M, N, K,
        stride_xm, stride_wn, stride_sn,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, K_STEPS: tl.constexpr, SPLIT_K: tl.constexpr,
        USE_DOT: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH_L2: tl.constexpr,
        PIECES: tl.constexpr, PIECE_BYTES: tl.constexpr, DOT_F16: tl.constexpr,
    ):
        # out is a contiguous [M, N] BF16 tensor; ws an fp32 [SPLIT_K, M, N] workspace and cnt
        # one int32 ticket per (n tile, m tile), zero between calls (the last program resets it).
        QB: tl.constexpr = 128  # ops.fp8.QUANT_BLOCK (a literal: the JIT reads no plain module globals)
        KK: tl.constexpr = K_STEPS * QB
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        pid_k = tl.program_id(2)
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        # Rows past N re-read the program's first row instead of predicating every load.
        rows_n = tl.where(mask_n, offs_n, pid_n * BLOCK_N).to(tl.int64)
        k_blocks = K // QB
        kb_per = k_blocks // SPLIT_K
        kb_lo = pid_k * kb_per
        if PREFETCH_L2:
            _prefetch_rows_l2(w_ptr + pid_k * (PIECES * PIECE_BYTES), rows_n, stride_wn,
                              BLOCK_N, PIECES, PIECE_BYTES)
        if USE_PDL:
            tl.extra.cuda.gdc_launch_dependents()
            tl.extra.cuda.gdc_wait()  # x may be the previous kernel's output
        s_row = s_ptr + ((pid_n * BLOCK_N) // QB) * stride_sn  # BLOCK_N divides 128: one scale row
        m0 = pid_m * BLOCK_M
        if USE_DOT:
            offs_m = m0 + tl.arange(0, BLOCK_M)
            mask_m = offs_m < M
            rows_m = tl.where(mask_m, offs_m, 0).to(tl.int64)
            offs_k = tl.arange(0, QB)
            w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_k[None, :]
            x_ptrs = x_ptr + rows_m[None, :] * stride_xm + offs_k[:, None]  # [QB, BLOCK_M]
            acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            if DOT_F16:
                # FP16 tensor cores: e4m3 -> fp16 is one cvt per two weights (BF16 needs the slow
                # F2F unit). x is scaled per row by a power of two 2**-e so that |x| < 2**15 fits
                # fp16; a BF16 x is then exact in fp16 down to 2**-14 of the scaled range (below
                # that, fp16 subnormals round it by at most 2**-38 of the row's max |x|).
                amax = tl.zeros((BLOCK_M,), dtype=tl.float32)
                for kb in range(kb_lo, kb_lo + kb_per):
                    xt = tl.load(x_ptrs + kb * QB, mask=mask_m[None, :], other=0.0).to(tl.float32)
                    amax = tl.maximum(amax, tl.max(tl.abs(xt), axis=0))
                e = tl.where(amax > 0, tl.ceil(tl.log2(tl.maximum(amax, 1e-30))) - 14.0, 0.0)
                x_down = tl.exp2(-e)
                for kb in range(kb_lo, kb_lo + kb_per, K_STEPS):
                    for j in tl.static_range(K_STEPS):
                        w = tl.load(w_ptrs + (kb + j) * QB, eviction_policy="evict_first")
                        xt = tl.load(x_ptrs + (kb + j) * QB)
                        x16 = (xt.to(tl.float32) * x_down[None, :]).to(tl.float16)
                        acc += tl.dot(w.to(tl.float16), x16) * tl.load(s_row + kb + j)
                acc = acc * tl.exp2(e)[None, :]
            else:
                for kb in range(kb_lo, kb_lo + kb_per, K_STEPS):
                    for j in tl.static_range(K_STEPS):
                        w = tl.load(w_ptrs + (kb + j) * QB, eviction_policy="evict_first")
                        xt = tl.load(x_ptrs + (kb + j) * QB)
                        acc += tl.dot(w.to(tl.bfloat16), xt) * tl.load(s_row + kb + j)
            if SPLIT_K == 1:
                tl.store(out_ptr + offs_m[None, :] * N + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
                         mask=mask_n[:, None] & mask_m[None, :])
            else:
                tl.store(ws_ptr + (pid_k * M + offs_m[None, :]) * N + offs_n[:, None], acc,
                         mask=mask_n[:, None] & mask_m[None, :])
        else:
            # BLOCK_M (1, 2 or 4) activation rows share each converted weight tile.
            offs_kk = tl.arange(0, KK)
            zero_n = tl.zeros([BLOCK_N, 1], dtype=tl.int32)
            w_ptrs = w_ptr + rows_n[:, None] * stride_wn + offs_kk[None, :]
            s_ptrs = s_row + (offs_kk // QB)[None, :] + zero_n
            x_ptrs = x_ptr + offs_kk[None, :] + zero_n
            # rows past M re-read row M-1 (their results are not stored)
            x0 = x_ptrs + tl.minimum(m0, M - 1).to(tl.int64) * stride_xm
            x1 = x_ptrs + tl.minimum(m0 + 1, M - 1).to(tl.int64) * stride_xm
            x2 = x_ptrs + tl.minimum(m0 + 2, M - 1).to(tl.int64) * stride_xm
            x3 = x_ptrs + tl.minimum(m0 + 3, M - 1).to(tl.int64) * stride_xm
            a0 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            a1 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            a2 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            a3 = tl.zeros((BLOCK_N,), dtype=tl.float32)
            for kb in range(kb_lo, kb_lo + kb_per, K_STEPS):
                off = kb * QB
                w = tl.load(w_ptrs + off, eviction_policy="evict_first").to(tl.float32)
                sc = tl.load(s_ptrs + kb)
                a0 = _row_dot(a0, w, x0 + off, sc)
                if BLOCK_M > 1:
                    a1 = _row_dot(a1, w, x1 + off, sc)
                if BLOCK_M > 2:
                    a2 = _row_dot(a2, w, x2 + off, sc)
                    a3 = _row_dot(a3, w, x3 + off, sc)
            _store_row(out_ptr, ws_ptr, m0, a0, offs_n, mask_n, N, M, pid_k, SPLIT_K)
            if BLOCK_M > 1:
                _store_row(out_ptr, ws_ptr, m0 + 1, a1, offs_n, mask_n, N, M, pid_k, SPLIT_K)
            if BLOCK_M > 2:
                _store_row(out_ptr, ws_ptr, m0 + 2, a2, offs_n, mask_n, N, M, pid_k, SPLIT_K)
                _store_row(out_ptr, ws_ptr, m0 + 3, a3, offs_n, mask_n, N, M, pid_k, SPLIT_K)
        if SPLIT_K > 1:
            # Split-K: the last of the SPLIT_K programs of this tile (ticket) sums the fp32
            # partials in a fixed order, writes BF16 and resets the ticket for the next call.
            tl.debug_barrier()  # every thread's partial stores precede the release below
            tile = pid_m * tl.num_programs(0) + pid_n
            ticket = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
            if ticket == SPLIT_K - 1:
                offs_r = m0 + tl.arange(0, BLOCK_M)
                mask = (offs_r < M)[:, None] & mask_n[None, :]
                part = ws_ptr + offs_r[:, None] * N + offs_n[None, :]
                total = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
                for p in tl.static_range(SPLIT_K):
                    total += tl.load(part + p * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                tl.store(out_ptr + offs_r[:, None] * N + offs_n[None, :], total.to(out_ptr.dtype.element_ty),
                         mask=mask)
                tl.atomic_xchg(cnt_ptr + tile, 0, sem="relaxed", scope="gpu")

else:
    _w8a16_block_fp8_kernel = None
