"""The Triton kernel of :mod:`vllm_ling.ops.kda_decode` (imported only where it launches: Triton
is a GPU dependency; the CPU tests run it under ``TRITON_INTERPRET=1``).

Sums, sigmoids and zeros are written with ``tl.reduce``, ``tl.exp`` and ``tl.full`` rather than
``tl.sum``, ``tl.sigmoid`` and ``tl.zeros``: those are jitted functions of Triton's standard library,
which the interpreter cannot run when Triton was imported before ``TRITON_INTERPRET`` was set (vLLM
imports it first in the tests). ``tl.reduce`` with the standard library's own sum combiner is what
``tl.sum`` compiles to, and what the interpreter sums with numpy."""

import triton
import triton.language as tl


@triton.jit
def _sum(x, axis: tl.constexpr):
    return tl.reduce(x, axis, tl.standard._sum_combine)


@triton.jit
def _sigmoid(x):
    return 1.0 / (1.0 + tl.exp(-x))


@triton.jit
def _round_bf16(v):
    """float32 ``v`` rounded to the nearest BF16 value, ties to even (finite values), as float32: the
    rounding of vLLM's BF16 stores, written out because Triton's interpreter truncates its casts."""
    bits = v.to(tl.uint32, bitcast=True)
    bits = ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16) << 16
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _conv(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, chans, conv_slot, offset, bos, seqlen,
          W: tl.constexpr, MAX_T: tl.constexpr, LP: tl.constexpr):
    """The conv over ``chans`` for the window's tokens -> (outputs [MAX_T, len(chans)] float32 after silu,
    rounded as BF16 stores round; rows past ``seqlen`` zero, the channels' conv state after, [LP, len(chans)]:
    the window without its oldest column, to be stored by :func:`_conv_state_store`)."""
    t = tl.arange(0, MAX_T)[:, None]
    c = chans[None, :]
    base = conv_state + conv_slot * stride_cs + c * stride_cc
    # out[t, c] = sum_j window[t + j, c] * w[c, j]: one [MAX_T, channels] tile per tap, all in one layout
    for j in tl.static_range(W):
        r = t + j  # the window row: the conv state's columns, then the sequence's new tokens
        hist = r < W - 1
        new = (r >= W - 1) & (r < W - 1 + seqlen)
        tile = tl.where(hist, tl.load(base + (offset + r) * stride_cl, mask=hist, other=0.0),
                        tl.load(x + (bos + tl.maximum(r - (W - 1), 0)) * stride_x + c, mask=new, other=0.0))
        term = tile.to(tl.float32) * tl.load(conv_w + chans * W + j).to(tl.float32)[None, :]
        if j == 0:
            acc = term
        else:
            acc += term
    out = acc * _sigmoid(acc)
    out = _round_bf16(out)  # what vLLM's conv stores (BF16 activations) and its recurrence loads
    out = tl.where(t < seqlen, out, 0.0)
    return out, _conv_moved(x, stride_x, conv_state, stride_cs, stride_cc, stride_cl, chans, conv_slot, offset, bos,
                            seqlen, W, LP)


@triton.jit
def _conv_moved(x, stride_x, conv_state, stride_cs, stride_cc, stride_cl, chans, conv_slot, offset, bos, seqlen,
                W: tl.constexpr, LP: tl.constexpr):
    """The channels' conv state after the window, [LP, len(chans)]: window rows 1 .. W - 2 + seqlen (the
    oldest dropped), for columns 0 .. (stored by :func:`_conv_state_store`)."""
    c = chans[None, :]
    base = conv_state + conv_slot * stride_cs + c * stride_cc
    j = tl.arange(0, LP)[:, None]
    keep = j < W - 2 + seqlen
    from_hist = j < W - 2
    return tl.where(from_hist, tl.load(base + (offset + j + 1) * stride_cl, mask=keep & from_hist, other=0.0),
                    tl.load(x + (bos + tl.maximum(j - (W - 2), 0)) * stride_x + c, mask=keep & (j >= W - 2),
                            other=0.0))


@triton.jit
def _conv_token(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, chans, conv_slot, offset, bos, t,
                W: tl.constexpr):
    """The conv output of the window's token ``t`` (a runtime index) over ``chans``: [len(chans)] float32 after
    silu, rounded as BF16 stores round (the streamed token loop's; :func:`_conv` makes every token's at once)."""
    base = conv_state + conv_slot * stride_cs + chans * stride_cc
    for j in tl.static_range(W):
        r = chans * 0 + t + j  # the window row, as a vector: the conv state's columns, then the new tokens
        hist = r < W - 1
        tap = tl.where(hist, tl.load(base + (offset + r) * stride_cl, mask=hist, other=0.0),
                       tl.load(x + (bos + tl.maximum(r - (W - 1), 0)) * stride_x + chans, mask=r >= W - 1, other=0.0))
        term = tap.to(tl.float32) * tl.load(conv_w + chans * W + j).to(tl.float32)
        if j == 0:
            acc = term
        else:
            acc += term
    return _round_bf16(acc * _sigmoid(acc))


@triton.jit
def _conv_state_store(conv_state, stride_cs, stride_cc, stride_cl, chans, conv_slot, seqlen, moved,
                      W: tl.constexpr, LP: tl.constexpr):
    j = tl.arange(0, LP)[:, None]
    tl.debug_barrier()  # every thread's loads of this state (the window, ``moved``) before the store
    tl.store(conv_state + conv_slot * stride_cs + chans[None, :] * stride_cc + j * stride_cl, moved,
             mask=j < W - 2 + seqlen)


@triton.jit
def _row(tile, t, MAX_T: tl.constexpr):
    rows = tl.arange(0, MAX_T)[:, None]
    return _sum(tl.where(rows == t, tile, 0.0), axis=0)


@triton.jit
def _gate(raw, a, lower_bound, SAFE_GATE: tl.constexpr, THRESHOLD: tl.constexpr):
    if SAFE_GATE:
        g = lower_bound * _sigmoid(a * raw)
    else:
        g = -a * tl.where(raw > THRESHOLD, raw, tl.log(1.0 + tl.exp(raw)))
    return g


@triton.jit
def _store_qk_conv_state(conv_state, stride_cs, stride_cc, stride_cl, readers, P, n, h, part, conv_slot, seqlen,
                         moved_q, moved_k, D: tl.constexpr, W: tl.constexpr, LP: tl.constexpr,
                         SPLIT: tl.constexpr):
    """The head's q and k conv state: every program of the head reads it, the last one writes it once the
    others said they are done reading (they are dispatched before it: it never waits on one not started)."""
    d = tl.arange(0, D)
    if SPLIT > 1:
        count = readers + n * tl.num_programs(1) + h
        if part < SPLIT - 1:
            tl.debug_barrier()  # every thread's loads of it done
            tl.atomic_add(count, 1, sem="release")
        else:
            seen = tl.atomic_add(count, 0, sem="acquire")
            while seen < SPLIT - 1:
                seen = tl.atomic_add(count, 0, sem="acquire")
    if part == SPLIT - 1:
        _conv_state_store(conv_state, stride_cs, stride_cc, stride_cl, h * D + d, conv_slot, seqlen, moved_q, W, LP)
        _conv_state_store(conv_state, stride_cs, stride_cc, stride_cl, P + h * D + d, conv_slot, seqlen, moved_k,
                          W, LP)
        if SPLIT > 1:
            tl.atomic_xchg(count, 0)  # ready for the next step (and the next replay of a CUDA graph)


@triton.jit
def _stream_token(x, stride_x, f, stride_f, b, stride_b, conv_w, conv_state, stride_cs, stride_cc, stride_cl, state,
                  stride_ss, stride_sh, slots, stride_slot_n, stride_slot_t, o, stride_ot, stride_oh, scale,
                  lower_bound, eps, P, h, n, bos, offset, conv_slot, a, bias, d, vd, tile, t, S,
                  D: tl.constexpr, W: tl.constexpr, SPEC: tl.constexpr, SAFE_GATE: tl.constexpr,
                  HAS_BIAS: tl.constexpr, THRESHOLD: tl.constexpr):
    """One token of the streamed step: its inputs, the state's update (returned), its output and, in a verify
    window, its state snapshot."""
    q = _conv_token(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, h * D + d, conv_slot,
                    offset, bos, t, W)
    k = _conv_token(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, P + h * D + d,
                    conv_slot, offset, bos, t, W)
    v = _conv_token(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, 2 * P + h * D + vd,
                    conv_slot, offset, bos, t, W)
    q = q / tl.sqrt(_sum(q * q, axis=0) + eps) * scale
    k = k / tl.sqrt(_sum(k * k, axis=0) + eps)
    raw = tl.load(f + (bos + t) * stride_f + h * D + d).to(tl.float32)
    if HAS_BIAS:
        raw += bias
    g = _gate(raw, a, lower_bound, SAFE_GATE, THRESHOLD)
    beta = _sigmoid(tl.load(b + (bos + t) * stride_b + h).to(tl.float32))
    S = S * tl.exp(g)[None, :]
    u = beta * (v - _sum(S * k[None, :], axis=1))
    S = S + u[:, None] * k[None, :]
    out = _sum(S * q[None, :], axis=1)
    tl.store(o + (bos + t) * stride_ot + h * stride_oh + vd, _round_bf16(out).to(o.dtype.element_ty))
    if SPEC:
        dst = tl.load(slots + n * stride_slot_n + t * stride_slot_t).to(tl.int64)
        tl.store(state + dst * stride_ss + h * stride_sh + tile, S.to(state.dtype.element_ty),
                 mask=tile * 0 + dst > 0)
    return S


@triton.jit
def _streamed_step(x, stride_x, f, stride_f, b, stride_b, conv_w, conv_state, stride_cs, stride_cc, stride_cl,
                   A_log, dt_bias, state, stride_ss, stride_sh, stride_sv, stride_sk, slots, stride_slot_n,
                   stride_slot_t, o, stride_ot, stride_oh, readers, scale, lower_bound, eps, P, part, h, n, bos,
                   seqlen, offset, state_base, conv_slot,
                   D: tl.constexpr, W: tl.constexpr, LP: tl.constexpr, BV: tl.constexpr, SPLIT: tl.constexpr,
                   SPEC: tl.constexpr, SAFE_GATE: tl.constexpr, HAS_BIAS: tl.constexpr, THRESHOLD: tl.constexpr,
                   PIPELINE: tl.constexpr):
    """The step with its tokens in a loop of the window's length: each token's q, k, v, gate and beta made
    from memory in its own iteration (the conv windows' rows are cache hits), so a long window costs its
    tokens, where the tile path's unrolled loop runs to the window padded to a power of two and pulls each
    token's row out of [window, D] tiles. ``PIPELINE``: the loop software-pipelined by Triton (two stages:
    the next token's loads, which only the state's update does not precede, in flight during this token's;
    lease 2026-12-07e served the plain loop at 61.9 us per layer for 9 tokens, about 6.9 us a token). Every
    conv-state store comes after the loop, once nothing reads it."""
    d = tl.arange(0, D)
    a = tl.exp(tl.load(A_log + h).to(tl.float32))
    if HAS_BIAS:
        bias = tl.load(dt_bias + h * D + d).to(tl.float32)
    else:
        bias = tl.zeros([D], tl.float32)  # unread
    first = part * (D // SPLIT)
    for j in tl.static_range(D // SPLIT // BV):
        vd = first + j * BV + tl.arange(0, BV)
        tile = vd[:, None] * stride_sv + d[None, :] * stride_sk
        S = tl.load(state_base + tile).to(tl.float32)
        # PIPELINE: two stages (Triton's pipeliner); one stage is the plain loop
        for t in tl.range(0, seqlen, num_stages=1 + PIPELINE):
            S = _stream_token(x, stride_x, f, stride_f, b, stride_b, conv_w, conv_state, stride_cs, stride_cc,
                              stride_cl, state, stride_ss, stride_sh, slots, stride_slot_n, stride_slot_t, o,
                              stride_ot, stride_oh, scale, lower_bound, eps, P, h, n, bos, offset, conv_slot, a,
                              bias, d, vd, tile, t, S, D, W, SPEC, SAFE_GATE, HAS_BIAS, THRESHOLD)
        if not SPEC:
            tl.store(state_base + tile, S.to(state.dtype.element_ty))
        # this block's v conv state: its program alone reads and writes it
        moved_v = _conv_moved(x, stride_x, conv_state, stride_cs, stride_cc, stride_cl, 2 * P + h * D + vd, conv_slot,
                              offset, bos, seqlen, W, LP)
        _conv_state_store(conv_state, stride_cs, stride_cc, stride_cl, 2 * P + h * D + vd, conv_slot, seqlen, moved_v,
                          W, LP)
    moved_q = _conv_moved(x, stride_x, conv_state, stride_cs, stride_cc, stride_cl, h * D + d, conv_slot, offset, bos,
                          seqlen, W, LP)
    moved_k = _conv_moved(x, stride_x, conv_state, stride_cs, stride_cc, stride_cl, P + h * D + d, conv_slot, offset,
                          bos, seqlen, W, LP)
    _store_qk_conv_state(conv_state, stride_cs, stride_cc, stride_cl, readers, P, n, h, part, conv_slot, seqlen,
                         moved_q, moved_k, D, W, LP, SPLIT)


@triton.jit
def _gated_output_norm(o, stride_ot, stride_oh, gate, stride_gate, norm_w, norm_eps, readers, part, h, n, bos,
                       seqlen, D: tl.constexpr, MAX_T: tl.constexpr, SPLIT: tl.constexpr):
    """The layer's gated output norm over the head's stored outputs, in place: ``o * rsqrt(mean(o^2) + eps) *
    w * sigmoid(gate)`` per token, in fp32 from the BF16 values stored, rounded once (vLLM's
    ``FusedRMSNormGated``, sigmoid). It needs the whole head: with a split head the other programs count
    themselves done on the head's second counter once their outputs are stored, and the last one (dispatched
    after them) waits for them, then normalizes the head's rows."""
    if SPLIT > 1:
        count = readers + tl.num_programs(2) * tl.num_programs(1) + n * tl.num_programs(1) + h
        tl.debug_barrier()  # every thread's output stores issued before the count says so
        if part < SPLIT - 1:
            tl.atomic_add(count, 1, sem="release")
        else:
            seen = tl.atomic_add(count, 0, sem="acquire")
            while seen < SPLIT - 1:
                seen = tl.atomic_add(count, 0, sem="acquire")
            tl.atomic_xchg(count, 0)  # ready for the next step (and the next replay of a CUDA graph)
    if part == SPLIT - 1:
        tl.debug_barrier()  # this program's own stores (and the others', acquired above) before the reads
        d = tl.arange(0, D)
        rows = tl.arange(0, MAX_T)[:, None]
        live = rows < seqlen
        at = o + (bos + rows) * stride_ot + h * stride_oh + d[None, :]
        x = tl.load(at, mask=live, other=0.0, cache_modifier=".cg").to(tl.float32)
        gt = tl.load(gate + (bos + rows) * stride_gate + h * D + d[None, :], mask=live, other=0.0).to(tl.float32)
        w = tl.load(norm_w + d).to(tl.float32)
        y = x / tl.sqrt(_sum(x * x, axis=1)[:, None] / D + norm_eps) * w[None, :] * _sigmoid(gt)
        tl.store(at, _round_bf16(y).to(o.dtype.element_ty), mask=live)


@triton.jit
def kda_decode_kernel(
        x, stride_x, f, stride_f, b, stride_b, conv_w, conv_state, stride_cs, stride_cc, stride_cl,
        A_log, dt_bias, state, stride_ss, stride_sh, stride_sv, stride_sk,
        slots, stride_slot_n, stride_slot_t, cu_seqlens, accepted, o, stride_ot, stride_oh, readers,
        gate, stride_gate, norm_w, norm_eps, scale, lower_bound, eps, P,
        D: tl.constexpr, W: tl.constexpr, MAX_T: tl.constexpr, LP: tl.constexpr,
        BV: tl.constexpr, SPLIT: tl.constexpr, SPEC: tl.constexpr, SAFE_GATE: tl.constexpr,
        HAS_BIAS: tl.constexpr, THRESHOLD: tl.constexpr, USE_PDL: tl.constexpr, PREFETCH: tl.constexpr,
        STREAM: tl.constexpr, NORM: tl.constexpr):
    # program (part, head, sequence): ``SPLIT`` programs share a head, each its D / SPLIT value channels
    part = tl.program_id(0)
    h = tl.program_id(1)
    n = tl.program_id(2)
    if SPEC:
        bos = tl.load(cu_seqlens + n).to(tl.int64)
        seqlen = tl.load(cu_seqlens + n + 1).to(tl.int64) - bos
        offset = tl.load(accepted + n).to(tl.int64) - 1
        start = tl.load(slots + n * stride_slot_n + offset * stride_slot_t).to(tl.int64)
        conv_slot = tl.load(slots + n * stride_slot_n).to(tl.int64)
    else:
        bos = n.to(tl.int64)
        seqlen = bos * 0 + 1
        offset = bos * 0
        start = tl.load(slots + n * stride_slot_n).to(tl.int64)
        conv_slot = start
    d = tl.arange(0, D)
    own = part * (D // SPLIT) + tl.arange(0, D // SPLIT)  # this program's value channels
    rows = tl.arange(0, MAX_T)[:, None]
    # PREFETCH: the first value block's state (the largest read) issued first: before the convolutions, which
    # it does not depend on (the compiler cannot move it above their conv-state stores: it cannot tell the
    # pools apart), and, launched as a programmatic dependent, before the wait for the kernel before (a
    # padding sequence's slot, <= 0, reads row 0 here and nothing after); each next block's during the one
    # before. It holds a block's state in registers across the convolutions: blocks of 64 or 128 channels
    # spill (lease 2026-12-07a), so it is the launch configuration's choice
    state_base = state + tl.maximum(start, 0) * stride_ss + h * stride_sh
    first = part * (D // SPLIT)
    tile = (first + tl.arange(0, BV))[:, None] * stride_sv + d[None, :] * stride_sk
    if PREFETCH:
        if not STREAM:  # (the streamed path's PREFETCH pipelines its token loop instead)
            S_next = tl.load(state_base + tile)
    if USE_PDL:
        # the next kernel may start now (it waits for this grid's end before it reads what this one writes):
        # with the output norm here, that is the out-projection, whose weights then stream during this step
        tl.extra.cuda.gdc_launch_dependents()
        # x, f and the beta logits are the kernels' before; so may be the memory the stores below write
        tl.extra.cuda.gdc_wait()
    if (start <= 0) | (conv_slot <= 0):  # vLLM's null block: padding; zero output, no state touched
        for t in tl.static_range(MAX_T):
            zeros = tl.full([D // SPLIT], 0.0, tl.float32).to(o.dtype.element_ty)
            tl.store(o + (bos + t) * stride_ot + h * stride_oh + own, zeros, mask=own * 0 + seqlen > t)
        return
    if STREAM:  # long verify windows (kda_decode.TILE_WINDOW_MAX)
        _streamed_step(x, stride_x, f, stride_f, b, stride_b, conv_w, conv_state, stride_cs, stride_cc, stride_cl,
                       A_log, dt_bias, state, stride_ss, stride_sh, stride_sv, stride_sk, slots, stride_slot_n,
                       stride_slot_t, o, stride_ot, stride_oh, readers, scale, lower_bound, eps, P, part, h, n, bos,
                       seqlen, offset, state_base, conv_slot, D, W, LP, BV, SPLIT, SPEC, SAFE_GATE, HAS_BIAS,
                       THRESHOLD, PREFETCH)
    else:
        # Every load no store of this step can change, issued together: the q, k and first value block's conv
        # windows, the gate, A and beta (one memory round trip rather than one per stage: the compiler keeps a
        # load below any earlier store to a pool it cannot tell apart, such as the conv state's q/k channels)
        q, moved_q = _conv(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, h * D + d,
                           conv_slot, offset, bos, seqlen, W, MAX_T, LP)
        k, moved_k = _conv(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, P + h * D + d,
                           conv_slot, offset, bos, seqlen, W, MAX_T, LP)
        v_first, moved_v_first = _conv(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl,
                                       2 * P + h * D + first + tl.arange(0, BV), conv_slot, offset, bos, seqlen, W,
                                       MAX_T, LP)
        live = rows < seqlen
        raw = tl.load(f + (bos + rows) * stride_f + h * D + d[None, :], mask=live, other=0.0).to(tl.float32)
        if HAS_BIAS:
            raw += tl.load(dt_bias + h * D + d).to(tl.float32)[None, :]
        a = tl.exp(tl.load(A_log + h).to(tl.float32))
        t1 = tl.arange(0, MAX_T)
        beta = _sigmoid(tl.load(b + (bos + t1) * stride_b + h, mask=t1 < seqlen, other=0.0).to(tl.float32))
        q = q / tl.sqrt(_sum(q * q, axis=1)[:, None] + eps) * scale
        k = k / tl.sqrt(_sum(k * k, axis=1)[:, None] + eps)
        # the head's q and k conv state, read above by every program of the head
        _store_qk_conv_state(conv_state, stride_cs, stride_cc, stride_cl, readers, P, n, h, part, conv_slot, seqlen,
                             moved_q, moved_k, D, W, LP, SPLIT)
        g = _gate(raw, a, lower_bound, SAFE_GATE, THRESHOLD)
        g = tl.where(live, g, 0.0)  # past the window: no decay, k = 0, so the state stays
        for j in tl.static_range(D // SPLIT // BV):
            vd = first + j * BV + tl.arange(0, BV)
            tile = vd[:, None] * stride_sv + d[None, :] * stride_sk
            if PREFETCH:
                S = S_next.to(tl.float32)
                if j + 1 < D // SPLIT // BV:  # the next block's state in flight while this block computes
                    S_next = tl.load(state_base + tile + BV * stride_sv)
            else:
                S = tl.load(state_base + tile).to(tl.float32)
            if j == 0:
                v, moved_v = v_first, moved_v_first
            else:
                v, moved_v = _conv(x, stride_x, conv_w, conv_state, stride_cs, stride_cc, stride_cl, 2 * P + h * D + vd,
                                   conv_slot, offset, bos, seqlen, W, MAX_T, LP)
            _conv_state_store(conv_state, stride_cs, stride_cc, stride_cl, 2 * P + h * D + vd, conv_slot, seqlen,
                              moved_v, W, LP)
            for t in tl.static_range(MAX_T):
                kt = _row(k, t, MAX_T)
                S = S * tl.exp(_row(g, t, MAX_T))[None, :]
                u = _sum(tl.where(t1 == t, beta, 0.0), axis=0) * (_row(v, t, MAX_T) - _sum(S * kt[None, :], axis=1))
                S = S + u[:, None] * kt[None, :]
                out = _sum(S * _row(q, t, MAX_T)[None, :], axis=1)
                tl.store(o + (bos + t) * stride_ot + h * stride_oh + vd, _round_bf16(out).to(o.dtype.element_ty),
                         mask=(vd < D) & (vd * 0 + seqlen > t))
                if SPEC:
                    dst = tl.load(slots + n * stride_slot_n + tl.minimum(seqlen - 1, t) * stride_slot_t).to(tl.int64)
                    dst = tl.where(seqlen > t, dst, 0)
                    tl.store(state + dst * stride_ss + h * stride_sh + tile, S.to(state.dtype.element_ty),
                             mask=tile * 0 + dst > 0)
            if not SPEC:
                tl.store(state_base + tile, S.to(state.dtype.element_ty))
    if NORM:
        _gated_output_norm(o, stride_ot, stride_oh, gate, stride_gate, norm_w, norm_eps, readers, part, h, n, bos,
                           seqlen, D, MAX_T, SPLIT)
