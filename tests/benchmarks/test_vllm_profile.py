"""benchmarks/vllm_profile.py reads vLLM's torch-profiler traces (CPU; the traces come from the H200)."""

from __future__ import annotations

import gzip
import json

import pytest

from benchmarks import vllm_profile as V


def _trace(tmp_path):
    """Two vLLM steps as the torch profiler writes them: per step an ``execute_*`` CPU annotation, the
    launch calls inside it, kernels carrying the launch's correlation id; one kernel launched outside
    any step (the sampler) and one host synchronisation."""
    ev = []

    def step(name, ts, dur):
        ev.append({"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur})

    def kernel(name, corr, launch_ts, ts, dur):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": launch_ts, "dur": 3,
                   "args": {"correlation": corr}})
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                   "args": {"correlation": corr, "stream": 7}})

    step("execute_context_1(2048)_generation_0(0)", 0, 100)
    kernel("triton_red_fused_add_mean_mul_pow_rsqrt_0", 1, 10, 200, 10)      # norm
    kernel("ling_dense_w8a16_wave", 2, 20, 215, 30)                          # dense FP8 (5 us gap before)
    kernel("void humming<MmaOpClass, Shape<0u, 1536u, 2560u>>", 3, 30, 245, 50)  # routed MoE
    kernel("void cutlass_80_tensorop_bf16_s16816gemm_relu_bf16", 4, 40, 300, 40)  # after the MoE: the head
    step("execute_context_0(0)_generation_1(1)", 1000, 100)
    kernel("ling_moe_hl_down", 5, 1010, 1200, 20)
    kernel("void humming<MmaOpClass, Shape<0u, 157184u, 2560u>>", 6, 1020, 1220, 100)  # the FP8 head by shape
    kernel("argmax_kernel", 7, 1500, 1330, 5)  # launched after the step's annotation: joins its iteration
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 1600, "dur": 400,
               "args": {}})
    path = tmp_path / "prefill-2048_rank0.123.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    return path


def test_kernels_are_grouped_by_the_step_that_launched_them_and_classified(tmp_path):
    trace = _trace(tmp_path)
    out = V.write_compact(tmp_path, "prefill-2048", tmp_path)
    assert out is not None and out.name == "prefill-2048.compact.json.gz"
    result = V.analyse(V.load(out))
    first, second = result["steps"]
    assert (first["context_tokens"], first["generation_tokens"]) == (2048, 0)
    assert (second["context_tokens"], second["generation_tokens"]) == (0, 1)
    # step 0: kernels 200..340 us; the iteration runs to step 1's first kernel (1200)
    assert first["iteration_us"] == pytest.approx(1000.0)
    assert first["busy_us"] == pytest.approx(130.0) and first["gaps_us"] == pytest.approx(10.0)
    assert first["classes"] == {"norms_residual": 10.0, "dense_fp8": 30.0, "moe_routed": 50.0, "head": 40.0}
    # step 1: the sampler launched outside the annotation joins the step whose iteration it falls in
    assert second["classes"] == {"moe_routed": 20.0, "head": 100.0, "sampling": 5.0}
    assert second["kernels"] == 3
    assert result["long_host_calls_us"] == {"cudaStreamSynchronize": 400.0}
    assert trace.exists()


def test_rendered_decode_class_sits_beside_its_byte_floor(tmp_path):
    _trace(tmp_path)
    result = V.analyse(V.load(V.write_compact(tmp_path, "prefill-2048", tmp_path)))
    plan = {"components": [{"name": "routed experts MXFP4", "batch1_bytes": 4.0e6, "verify_bytes": 8.0e6}],
            "heads": {"fp8": {"head_bytes": 2.0e6}, "bf16": {"head_bytes": 4.0e6}}}
    floors = V.class_floor_us(plan, 32768, 1000.0, 1, "fp8")
    # 4 MB at 1000 GB/s = 4 us; the decode step's MoE kernels took 20 us: 5.0x the floor
    assert floors["moe_routed"] == (4.0e6, pytest.approx(4.0))
    text = "\n".join(V.render_window(result, floors))
    assert "| moe_routed | 20 | 20 | 0.16 | 1 | 4 | 4 | 5.0 |" in text
    assert "| head | 100 | 100 | 0.80 | 1 | 2 | 2 | 50.0 |" in text


def test_overlapping_kernels_count_once_in_the_wall_column():
    """A programmatic-dependent launch that starts while its producer runs, and a kernel on another
    stream beside both: their durations sum to more than the covered time, their wall shares to it."""
    ks = [{"name": "ling_moe_hs_gate_up", "ts": 0.0, "dur": 11.0, "stream": 1},
          {"name": "ling_dense_w8a16_wave", "ts": 0.5, "dur": 4.0, "stream": 2},  # the shared expert, inside
          {"name": "ling_moe_hl_down", "ts": 1.5, "dur": 16.0, "stream": 1},     # waits in the GPU, ends at 17.5
          {"name": "triton_red_fused_add_rms_norm_1", "ts": 20.0, "dur": 2.0, "stream": 1}]
    assert V.wall_shares(ks) == [11.0, 0.0, 6.5, 2.0]
    figures = V.step_figures({"annotation": "execute_context_0(0)_generation_1(1)", "context_tokens": 0,
                              "generation_tokens": 1, "iteration_us": 25.0, "kernels": ks})
    assert figures["classes"]["moe_routed"] == 27.0 and figures["wall"]["moe_routed"] == 17.5
    assert figures["wall"]["dense_fp8"] == 0.0 and figures["streams"] == 2
    assert sum(figures["wall"].values()) == pytest.approx(figures["busy_us"])


def test_names_of_the_kernels_vllm_runs_land_in_their_classes():
    cases = {
        "void humming<MmaOpClass, Shape<0u, 1536u, 2560u>, Shape<16u, 64u, 256u>>": "moe_routed",
        "void humming<MmaOpClass, Shape<0u, 157184u, 2560u>>": "head",
        "_grouped_topk_kernel": "router",
        "void cutlass::device_kernel<cutlass_3x_gemm_fp8_blockwise_sm90>": "dense_fp8",
        "fused_recurrent_kda_fwd_kernel": "kda_recurrent",
        "_causal_conv1d_update_kernel": "kda_conv",
        "void flash::flash_fwd_splitkv_mla_kernel<>": "mla_attention",
        # FlashMLA's and vLLM's MLA kernels as the profiler names them (shortened): words of other classes inside
        "void sm90::decode::dense::flash_fwd_splitkv_mla_kernel<sm90::decode::dense::Traits<cutlass::bfloat16_t>, "
        "cute::AuxTmaParams<cute::tuple<cute::ScaledBasis<cute::C<1>, 1>>>>(DenseAttnDecodeParams)": "mla_attention",
        "void smxx::decode::flash_fwd_mla_combine_kernel<cutlass::bfloat16_t, 512, 8, 160, 256>(CombineParams)":
            "mla_attention",
        "void vllm::concat_and_cache_mla_kernel<__nv_bfloat16, __nv_bfloat16, (vllm::Fp8KVCacheDataType)0>(...)":
            "mla_attention",
        "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_1": "norms_residual",
        "ling_small_gemv": "small_bf16",
        "nvjet_tst_64x8_64x16_4x1_v_bz_TNT": "bf16_gemm",
        "sm80_xmma_gemm_f32f32_f32f32_f32_tn_n_tilesize128x128x8_stage3_warpsize2x2x1_ffma_aligna4_alignc4_execute_"
        "kernel__5x_cublas": "fp32_gemm",
    }
    assert {n: V.classify(n) for n in cases} == cases


def test_a_kernel_serving_two_classes_shows_both_most_launches_first():
    """The same dense GEMM before the step's last MoE kernel (a dense linear) and after it (the head
    rule): the per-kernel table names both classes, not whichever came last."""
    ks = [{"name": n, "ts": t, "dur": 1.0} for n, t in (
        ("ling_dense_w8a16_stream", 0), ("ling_dense_w8a16_stream", 2), ("ling_moe_hl_down", 4),
        ("ling_dense_w8a16_stream", 6))]
    step = {"annotation": "execute_context_0(0)_generation_1(1)", "context_tokens": 0, "generation_tokens": 1,
            "iteration_us": 10.0, "kernels": ks}
    figures = V.step_figures(step)
    assert figures["by_name"]["ling_dense_w8a16_stream"] == [3, 3.0, "dense_fp8+head", 3.0]  # + wall us
    assert figures["classes"] == {"dense_fp8": 2.0, "moe_routed": 1.0, "head": 1.0}


def test_a_steps_host_side_counts_graph_and_eager_launches_and_names_what_each_sync_waited_after(tmp_path):
    """A prefill step whose pieces are graph launches (one call, several kernels) and eager launches,
    with a mask index's synchronisation inside it (a reduce, the copy to the host, the long sync), as
    vLLM's KDA prefill makes one per layer: the step's row counts 1 graph launch, 3 other calls, and
    names the reduce (not the copy) before its one sync; a sync outside the step is not its."""
    ev = []

    def launch(api, corr, ts):
        ev.append({"ph": "X", "cat": "cuda_runtime", "name": api, "ts": ts, "dur": 3, "args": {"correlation": corr}})

    def kernel(name, corr, ts):
        ev.append({"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": 5,
                   "args": {"correlation": corr, "stream": 7}})

    ev.append({"ph": "X", "cat": "user_annotation", "name": "execute_context_1(64)_generation_0(0)", "ts": 0,
               "dur": 500})
    launch("cudaGraphLaunch", 1, 10)
    kernel("triton_poi_fused_0", 1, 100)
    kernel("triton_red_fused_1", 1, 110)
    launch("cudaLaunchKernel", 2, 20)
    kernel("void at_cuda_detail::cub::detail::reduce::DeviceReduceSingleTileKernel", 2, 120)
    launch("cudaMemcpyAsync", 3, 30)
    kernel("Memcpy DtoH (Device -> Pinned)", 3, 130)
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 40, "dur": 300, "args": {}})
    launch("cuLaunchKernelEx", 4, 350)
    kernel("chunk_kda_fwd_kernel", 4, 360)
    ev.append({"ph": "X", "cat": "cuda_runtime", "name": "cudaStreamSynchronize", "ts": 900, "dur": 250, "args": {}})
    path = tmp_path / "prefill-64_rank0.1.pt.trace.json.gz"
    with gzip.open(path, "wt") as f:
        json.dump({"traceEvents": ev}, f)
    result = V.analyse(V.load(V.write_compact(tmp_path, "prefill-64", tmp_path)))
    [step] = result["steps"]
    assert step["launch_calls"] == {"cudaGraphLaunch": 1, "cudaLaunchKernel": 1, "cudaMemcpyAsync": 1,
                                    "cuLaunchKernelEx": 1}
    assert step["syncs"] == [(300.0, "void at_cuda_detail::cub::detail::reduce::DeviceReduceSingleTileKernel")]
    text = "\n".join(V.render_window(result))
    assert "| 0 | 1 | 3 | 1 | 300 | `void at_cuda_detail::cub::detail::reduce::DeviceReduceSingle` x1 |" in text
