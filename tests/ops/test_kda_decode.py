"""The one-launch KDA decode kernel (vllm_ling.ops.kda_decode): on CPU under Triton's interpreter
against the plain-PyTorch functions of vllm_ling.ops.kda (the known answer the server runs), with
faults it must catch and the shapes it refuses; on the GPU (``gpu`` marker) compiled, at Ling's
shape, against the known answer and against vLLM's own three kernels (conv update, fused_kda_gate,
fused_recurrent_kda: benchmarks/kda_decode.py's ``vllm_step``) on the same inputs. The GPU tests run in
the lease's ``cuts`` phase (scripts/h200_session.sh): ``python -m pytest -m gpu tests/ops/test_kda_decode.py``."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from benchmarks.kda_decode import CONFIGS as BENCHMARK_CONFIGS, vllm_step
from vllm_ling.ops.kda_decode import KdaDecodeCall, OutputNorm, kda_decode, launch_config
from vllm_ling.ops.known_answer.kda_decode import KDA_DECODE_RTOL, check_kda_decode, decode_calls, reference


@pytest.mark.parametrize("lower_bound,block_v,split,prefetch", [(-5.0, 16, 1, True), (None, 32, 1, True),
                                                               (-5.0, 16, 2, True), (-5.0, 16, 1, False),
                                                               (-5.0, 8, 2, False)])
def test_interpreted_kernel_passes_the_known_answer(interpreted_kda_decode, lower_bound, block_v, split, prefetch):
    """Both gates (Ling's safe gate and softplus), the value channels in one and in two blocks, a head
    split over two programs (the interpreter runs programs one after another, in index order, as the GPU
    dispatches them: the q/k conv state is written by the last program of a head), with each block's state
    read ahead (prefetch) or where it is used."""
    result = check_kda_decode(lambda call, out: kda_decode(call, out, block_v=block_v, split=split,
                                                           prefetch=prefetch),
                              "interpreted", heads=2, head_dim=32, lower_bound=lower_bound)
    assert result.passed, result.failing_inputs
    assert result.cases == 6 and result.max_error < KDA_DECODE_RTOL / 4


@pytest.mark.parametrize("block_v,split,lower_bound,num_spec,pipeline", [(32, 1, -5.0, 8, False),
                                                                        (16, 2, None, 5, False),
                                                                        (16, 2, -5.0, 8, True)])
def test_long_verify_windows_stream_and_pass_the_known_answer(interpreted_kda_decode, block_v, split, lower_bound,
                                                              num_spec, pipeline):
    """Windows longer than TILE_WINDOW_MAX (DSpark's 9 tokens: 8 drafts + 1) take the streamed path by default
    (a loop of the window's length, each token's inputs made in its iteration, every conv-state store after
    it); its known answer at a whole head and a head split over two programs (the last writes the q/k conv
    state once the other finished its loop), both gates. The plain decode in the same check takes the tile
    path. ``pipeline``: the token loop software-pipelined (the streamed path's prefetch), the same answer."""
    from vllm_ling.ops.kda_decode import TILE_WINDOW_MAX, streams

    assert num_spec + 1 > TILE_WINDOW_MAX and streams(True, num_spec + 1) and not streams(True, TILE_WINDOW_MAX)
    result = check_kda_decode(lambda call, out: kda_decode(call, out, block_v=block_v, split=split, prefetch=pipeline),
                              "interpreted, streamed", heads=1, head_dim=32, num_spec=num_spec, lower_bound=lower_bound)
    assert result.passed, result.failing_inputs
    assert result.cases == 6 and result.max_error < KDA_DECODE_RTOL / 4


def test_a_split_head_leaves_its_counters_at_zero_for_the_next_step(interpreted_kda_decode):
    from vllm_ling.ops import kda_decode as K

    call = next(c for name, c in decode_calls(2, 32, 4, 3, -5.0).items() if name.startswith("verify"))
    kda_decode(call, torch.empty((8, 2, 32), dtype=torch.bfloat16), block_v=16, split=2)
    counts = K._readers[torch.device("cpu")]
    assert counts.numel() >= 2 * 2 and int(counts.abs().sum()) == 0


def _faulty(fault):
    def launch(call: KdaDecodeCall, out: torch.Tensor) -> torch.Tensor:
        return kda_decode(fault(call), out, block_v=16)
    return launch


FAULTS = {
    # a kernel resuming every verify window after one accepted token (conv history and state slot)
    "accepted ignored": lambda c: dataclasses.replace(c, accepted=None if c.accepted is None
                                                      else torch.ones_like(c.accepted)),
    # the gate of another formula: softplus where Ling's safe gate serves
    "wrong gate": lambda c: dataclasses.replace(c, lower_bound=None),
    # heads' decay rates exchanged
    "heads' A_log swapped": lambda c: dataclasses.replace(c, A_log=c.A_log.flip(0)),
    # q unscaled
    "scale 1": lambda c: dataclasses.replace(c, scale=1.0),
    # the conv weight's taps in the other order
    "taps reversed": lambda c: dataclasses.replace(c, conv_weight=c.conv_weight.flip(1).contiguous()),
}


@pytest.mark.parametrize("fault", list(FAULTS))
def test_the_known_answer_fails_a_faulty_step(interpreted_kda_decode, fault):
    result = check_kda_decode(_faulty(FAULTS[fault]), "faulty", heads=2, head_dim=32, lower_bound=-5.0)
    assert not result.passed and result.max_error > 10 * KDA_DECODE_RTOL, (fault, result.max_error)
    assert not any("raised" in f for f in result.failing_inputs), result.failing_inputs  # wrong numbers, not a crash


@pytest.mark.parametrize("fault", ["accepted ignored", "taps reversed"])
def test_the_known_answer_fails_a_faulty_streamed_step(interpreted_kda_decode, fault):
    """The streamed path's own conv windows and resume position, wrong: caught."""
    result = check_kda_decode(_faulty(FAULTS[fault]), "faulty, streamed", heads=1, head_dim=32, num_spec=5,
                              lower_bound=-5.0)
    assert not result.passed and result.max_error > 10 * KDA_DECODE_RTOL, (fault, result.max_error)


# ---- the gated output norm inside the launch (vllm_ling.ops.kda_decode.OutputNorm)

@pytest.mark.parametrize("block_v,split,num_spec", [(16, 1, 3), (32, 1, 3), (16, 2, 3), (8, 4, 3), (16, 2, 8),
                                                    (32, 1, 8)])
def test_interpreted_kernel_with_the_output_norm_passes_the_known_answer(interpreted_kda_decode, block_v, split,
                                                                         num_spec):
    """The head's rows normed in the launch: one program holding the head, and heads split over two and four
    programs (the last one normalises the head after the others counted their rows stored), on the tile path
    (4-token windows) and the streamed one (9)."""
    result = check_kda_decode(lambda c, o: kda_decode(c, o, block_v=block_v, split=split), "interpreted, normed",
                              heads=2, head_dim=32, lower_bound=-5.0, num_spec=num_spec, norm_eps=1e-6)
    assert result.passed, result.failing_inputs
    assert result.cases == 6 and result.max_error < KDA_DECODE_RTOL / 4


NORM_FAULTS = {
    # the rows left as the core made them
    "norm skipped": lambda c: dataclasses.replace(c, output_norm=None),
    # the norm's weight not applied
    "weight ignored": lambda c: dataclasses.replace(c, output_norm=dataclasses.replace(
        c.output_norm, weight=torch.ones_like(c.output_norm.weight))),
    # each head gated by the next head's gate
    "another head's gate": lambda c: dataclasses.replace(c, output_norm=dataclasses.replace(
        c.output_norm, gate=c.output_norm.gate.roll(32, dims=-1).contiguous())),
}


@pytest.mark.parametrize("fault", list(NORM_FAULTS))
@pytest.mark.parametrize("split", [1, 2])
def test_the_known_answer_fails_a_faulty_output_norm(interpreted_kda_decode, fault, split):
    result = check_kda_decode(lambda c, o: kda_decode(NORM_FAULTS[fault](c), o, block_v=16, split=split),
                              "faulty norm", heads=2, head_dim=32, lower_bound=-5.0, norm_eps=1e-6)
    assert not result.passed and result.max_error > 10 * KDA_DECODE_RTOL, (fault, result.max_error)
    assert not any("raised" in f for f in result.failing_inputs), result.failing_inputs


def test_the_output_norm_leaves_both_counters_of_a_split_head_at_zero(interpreted_kda_decode):
    from vllm_ling.ops import kda_decode as K

    call = next(c for name, c in decode_calls(2, 32, 4, 3, -5.0, norm_eps=1e-6).items() if name.startswith("verify"))
    kda_decode(call, torch.empty((8, 2, 32), dtype=torch.bfloat16), block_v=16, split=2)
    counts = K._readers[torch.device("cpu")]
    assert counts.numel() >= K.COUNTERS_PER_HEAD * 2 * 2 and int(counts.abs().sum()) == 0


def test_padded_sequences_get_zero_rows_and_leave_every_state_alone(interpreted_kda_decode):
    call = decode_calls(2, 32, 4, 3, -5.0)["decode (3 sequences, the second padded)"]
    conv_state, state = call.conv_state.clone(), call.state.clone()
    served = dataclasses.replace(call, conv_state=conv_state, state=state,
                                 slots=torch.zeros_like(call.slots))  # every sequence padded
    out = torch.full((3, 2, 32), float("nan"), dtype=torch.bfloat16)
    kda_decode(served, out)
    assert torch.equal(out, torch.zeros_like(out))
    assert torch.equal(conv_state, call.conv_state) and torch.equal(state, call.state)


def test_the_launch_configuration_follows_the_measured_table_and_fits_the_head():
    """launch_config serves the launch table's row for the smallest measured batch holding the batch (the
    file read here on its own), that row's blocks with one program per head above the largest, and every
    choice tiles the head, however small."""
    import json
    from importlib import resources

    from vllm_ling.ops.kda_decode import LAUNCH_TABLE

    table = json.loads(resources.files("vllm_ling").joinpath(LAUNCH_TABLE).read_text())
    for step, spec, stream in (("plain", False, False), ("spec", True, False), ("stream", True, True)):
        rows = table.get(step, table["spec"])
        assert rows == sorted(rows) and len({r[0] for r in rows}) == len(rows), rows
        for seqs in range(1, 2 * rows[-1][0] + 2):
            row = next((r for r in rows if seqs <= r[0]), None)
            want = tuple(row[1:]) if row else (rows[-1][1], rows[-1][2], 1, rows[-1][4])
            assert launch_config(seqs, spec, 128, stream) == want, (step, seqs)
    for head_dim in (32, 64, 128, 256):
        for seqs in (1, 2, 3, 4, 5, 8, 256):
            for spec, stream in ((False, False), (True, False), (True, True)):
                block_v, _, split, _ = launch_config(seqs, spec, head_dim, stream)
                assert block_v <= head_dim and head_dim % (block_v * split) == 0, (head_dim, seqs, spec, stream)


def test_the_benchmark_writes_the_table_launch_config_reads(tmp_path, monkeypatch):
    """benchmarks/kda_decode.py --launch-table: the fastest configuration per measured batch, in the file's
    format; launch_config follows a table so written (the lease's cuts phase serves it)."""
    import json

    from benchmarks.kda_decode import launch_table_of
    from vllm_ling.ops import kda_decode as K

    bests = [(4, 1, (16, 1, 8, False)), (1, 1, (32, 4, 4, True)), (1, 4, (32, 2, 4, False)), (8, 1, (64, 8, 1, False)),
             (1, 9, (16, 2, 8, False))]
    table = launch_table_of(bests, "a test")
    assert table["plain"] == [[1, 32, 4, 4, True], [4, 16, 1, 8, False], [8, 64, 8, 1, False]]
    assert table["spec"] == [[1, 32, 2, 4, False]]
    assert table["stream"] == [[1, 16, 2, 8, False]]  # DSpark's 9-token windows: the streamed path's own rows
    path = tmp_path / "kda_decode_launch.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(K, "launch_table", lambda: K.table_from(json.loads(path.read_text())))
    assert K.launch_config(1, False, 128) == (32, 4, 4, True)
    assert K.launch_config(3, False, 128) == (16, 1, 8, False)
    assert K.launch_config(9, False, 128) == (64, 8, 1, False)
    assert K.launch_config(2, True, 128) == (32, 2, 1, False)  # above the largest measured window: one program
    assert K.launch_config(1, True, 128, stream=True) == (16, 2, 8, False)
    # a run that measured no streamed windows: they take the tile path's verify rows
    no_stream = launch_table_of(bests[:4], "no streamed windows")
    assert "stream" not in no_stream
    assert K.table_from(no_stream)["stream"] == K.table_from(no_stream)["spec"]
    with pytest.raises(ValueError, match="spec"):
        launch_table_of([(1, 1, (32, 4, 4, False))], "plain only")


def test_the_leases_cuts_phase_installs_the_table_where_launch_config_reads_it():
    from pathlib import Path

    from vllm_ling.ops.kda_decode import LAUNCH_TABLE

    script = (Path(__file__).resolve().parents[2] / "scripts/h200_session.sh").read_text()
    assert f'cp "$OUT/kda_decode_launch.json" vllm_ling/{LAUNCH_TABLE}' in script


def test_split_head_counters_grow_outside_captures_and_outgrown_ones_stay(monkeypatch):
    from vllm_ling.ops import kda_decode as K

    device = torch.device("cpu")
    small = K.reserve_reader_counts(device, 8)
    big = K.reserve_reader_counts(device, small.numel() + 1)
    assert big.numel() > small.numel() and int(big.abs().sum()) == 0
    assert any(t is small for t in K._retired)  # a graph captured with it still reads it
    assert K.reserve_reader_counts(device, 8) is big
    # a larger batch inside a CUDA graph capture is refused, not served from unzeroed memory
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="inside a CUDA graph capture"):
        K.reserve_reader_counts(torch.device("cuda"), 1 << 20)


def test_the_answer_itself_moves_the_state_it_should():
    """The reference writes exactly the slots named (plain: each sequence's; verify: one per position),
    nothing else, and resumes a window after its accepted prefix (two accepted counts differ)."""
    calls = decode_calls(2, 32, 4, 3, -5.0)
    plain = calls["decode (3 sequences, the second padded)"]
    _, conv_state, state = reference(plain)
    changed = {int(s) for s in range(state.shape[0]) if not torch.equal(state[s], plain.state[s])}
    assert changed == {3, 4}
    verify = next(c for name, c in calls.items() if name.startswith("verify"))
    _, _, state = reference(verify)
    changed = {int(s) for s in range(state.shape[0]) if not torch.equal(state[s], verify.state[s])}
    assert changed == set(verify.slots.flatten().tolist())
    other = dataclasses.replace(verify, accepted=verify.accepted.flip(0))
    assert not torch.allclose(reference(other)[0].float(), reference(verify)[0].float(), atol=1e-2)


@pytest.mark.parametrize("change,words", [
    (lambda c: dataclasses.replace(c, x=c.x.float()), "BF16 activations only"),
    (lambda c: dataclasses.replace(c, conv_weight=c.conv_weight.t().contiguous().t()), "contiguous"),
    (lambda c: dataclasses.replace(c, conv_state=c.conv_state[..., :1]), "conv state of 1 columns"),
    (lambda c: dataclasses.replace(c, accepted=None), "needs cu_seqlens and accepted"),
    (lambda c: dataclasses.replace(c, output_norm=OutputNorm(c.f, torch.ones(16), 1e-6)), "output norm: weight of 16"),
    (lambda c: dataclasses.replace(c, output_norm=OutputNorm(c.f[:2], torch.ones(32), 1e-6)), "output norm: .* gate"),
])
def test_the_launcher_refuses_what_the_kernel_cannot_take(change, words):
    call = next(c for name, c in decode_calls(2, 32, 4, 3, -5.0).items() if name.startswith("verify"))
    with pytest.raises(ValueError, match=words):
        kda_decode(change(call), torch.empty((8, 2, 32), dtype=torch.bfloat16))


# ---- on the GPU



def _on(call: KdaDecodeCall, device: str) -> KdaDecodeCall:
    return KdaDecodeCall(**{f.name: (v.clone().to(device) if torch.is_tensor(v := getattr(call, f.name)) else v)
                            for f in dataclasses.fields(call)})


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [(32, 128), (16, 64)])  # Ling-3.0-flash at TP=1; the tiny model
def test_on_the_gpu_the_kernel_passes_and_equals_vllms_three_kernels(heads, head_dim):
    result = check_kda_decode(kda_decode, "compiled", heads, head_dim, lower_bound=-5.0, device="cuda")
    assert result.passed, result.failing_inputs
    # DSpark's 9-token windows: the streamed path, at each configuration its launch table hands out, with its
    # token loop plain and software-pipelined (the streamed path's prefetch)
    for config in {launch_config(n, True, head_dim, stream=True)[:3] for n in (1, 2, 3, 4, 5, 8, 64)}:
        for pipeline in (False, True):
            result = check_kda_decode(lambda c, o, b=config, p=pipeline: kda_decode(c, o, block_v=b[0], num_warps=b[1],
                                                                                    split=b[2], prefetch=p),
                                      f"streamed {config} pipelined {pipeline}", heads, head_dim, num_spec=8,
                                      lower_bound=-5.0, device="cuda")
            assert result.passed, (config, pipeline, result.failing_inputs)
    # launched as a programmatic dependent by default on sm_90+: without
    result = check_kda_decode(lambda c, o: kda_decode(c, o, pdl=False), "no PDL", heads, head_dim, lower_bound=-5.0,
                              device="cuda")
    assert result.passed, result.failing_inputs
    # every configuration launch_config hands out, on both steps (the check above: the ones its batches get),
    # and the split heads the benchmark measures (its last program waits on the others' counts)
    configs = {launch_config(n, spec, head_dim) for n in (1, 2, 3, 4, 5, 8, 64) for spec in (False, True)}
    configs |= {(bv, w, s, pf) for bv, w, s, pf in BENCHMARK_CONFIGS if bv * s <= head_dim}
    for block_v, warps, split, prefetch in configs:
        result = check_kda_decode(lambda c, o: kda_decode(c, o, block_v=block_v, num_warps=warps, split=split,
                                                          prefetch=prefetch),
                                  f"bv{block_v} w{warps} x{split} prefetch {prefetch}", heads, head_dim,
                                  lower_bound=-5.0, device="cuda")
        assert result.passed, (block_v, warps, split, prefetch, result.failing_inputs)
    windows = decode_calls(heads, head_dim, 4, 3, -5.0, seed=1)
    streamed = decode_calls(heads, head_dim, 4, 8, -5.0, seed=2)
    windows.update({f"{name} (streamed)": call for name, call in streamed.items() if call.spec})
    for name, call in windows.items():
        ours, theirs = _on(call, "cuda"), _on(call, "cuda")
        out = torch.zeros((call.x.shape[0], heads, head_dim), dtype=torch.bfloat16, device="cuda")
        kda_decode(ours, out)
        step = vllm_step(theirs)  # vLLM's three kernels, as the benchmark times them
        if step is None:
            pytest.skip("the known answers passed; vLLM's kernels need vLLM (a kernel-only device bundle)")
        want = step()
        live = (ours.slots[:, 0] if ours.spec else ours.slots) > 0  # vLLM leaves a padded row unwritten
        rows = live.repeat_interleave(call.x.shape[0] // live.numel()) if ours.spec else live
        err = (out[rows].float() - want[rows].float()).norm(dim=-1) / want[rows].float().norm(dim=-1)
        assert float(err.max()) < KDA_DECODE_RTOL, (name, float(err.max()))
        assert torch.equal(ours.conv_state, theirs.conv_state), name
        written = torch.zeros(ours.state.shape[0], dtype=torch.bool, device="cuda")
        written[ours.slots.long().flatten()] = True
        written[0] = False
        state_err = ((ours.state - theirs.state)[written].norm(dim=(-1, -2))
                     / theirs.state[written].norm(dim=(-1, -2)))
        assert float(state_err.max()) < KDA_DECODE_RTOL, (name, float(state_err.max()))


@pytest.mark.gpu
@pytest.mark.parametrize("heads,head_dim", [(32, 128), (16, 64)])  # Ling-3.0-flash at TP=1; the tiny model
def test_on_the_gpu_the_output_norm_inside_the_launch_passes_and_equals_vllms_norm(heads, head_dim):
    """The launch with the gated output norm: its known answer at every configuration launch_config hands out
    and the benchmark measures (split heads: the last program normalises the head after the others' counts),
    on 4- and 9-token windows; and vLLM's three kernels followed by vLLM's norm kernel (``rms_norm_gated``,
    what ``FusedRMSNormGated.forward_cuda`` runs: benchmarks/kda_decode.py's ``vllm_step``) on the same inputs."""
    eps = 1e-6
    configs = {launch_config(n, spec, head_dim) for n in (1, 2, 3, 4, 5, 8, 64) for spec in (False, True)}
    configs |= {(bv, w, s, pf) for bv, w, s, pf in BENCHMARK_CONFIGS if bv * s <= head_dim}
    for num_spec in (3, 8):
        result = check_kda_decode(kda_decode, f"normed, {num_spec + 1}-token windows", heads, head_dim,
                                  num_spec=num_spec, lower_bound=-5.0, device="cuda", norm_eps=eps)
        assert result.passed, (num_spec, result.failing_inputs)
    for block_v, warps, split, prefetch in configs:
        result = check_kda_decode(lambda c, o: kda_decode(c, o, block_v=block_v, num_warps=warps, split=split,
                                                          prefetch=prefetch),
                                  f"normed bv{block_v} w{warps} x{split}", heads, head_dim, lower_bound=-5.0,
                                  device="cuda", norm_eps=eps)
        assert result.passed, (block_v, warps, split, prefetch, result.failing_inputs)
    for name, call in decode_calls(heads, head_dim, 4, 3, -5.0, seed=3, norm_eps=eps).items():
        norm = call.output_norm
        gate, weight = norm.gate.cuda(), norm.weight.cuda()
        ours = dataclasses.replace(_on(call, "cuda"), output_norm=OutputNorm(gate, weight, eps))
        theirs = dataclasses.replace(_on(call, "cuda"), output_norm=OutputNorm(gate, weight, eps))
        out = torch.zeros((call.x.shape[0], heads, head_dim), dtype=torch.bfloat16, device="cuda")
        kda_decode(ours, out)
        step = vllm_step(theirs)  # vLLM's three kernels, then its norm kernel, as the benchmark times them
        if step is None:
            pytest.skip("the known answers passed; vLLM's kernels need vLLM (a kernel-only device bundle)")
        want = step()
        live = (ours.slots[:, 0] if ours.spec else ours.slots) > 0
        rows = live.repeat_interleave(call.x.shape[0] // live.numel()) if ours.spec else live
        err = (out[rows].float() - want[rows].float()).norm(dim=-1) / want[rows].float().norm(dim=-1)
        assert float(err.max()) < KDA_DECODE_RTOL, (name, float(err.max()))
