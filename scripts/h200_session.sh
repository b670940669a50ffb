#!/usr/bin/env bash
# One command on the GPU device (H100 or H200) after `bash .gpuvllm/device-install.sh`
# (../shared/tools/device-vllm.sh): the GPU work of a lease, every log under $OUT (read after the call).
#
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh tests      # the gpu suite: the tiny `vllm-ling serve`
#                                                             # end-to-end tests, make demo's program and
#                                                             # the kernel tests, one process each, three at a time
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours       # full-size: vllm-ling defaults without MTP
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh upstream   # full-size: the upstream composition
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-mtp   # full-size: vllm-ling defaults (MTP x3)
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-dspark # full-size: DSpark, a dummy full-size drafter
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-flashmla # full-size: ours with vLLM's FlashMLA decode backend
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-kdavllm  # full-size: ours with vLLM's KDA decode kernels
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-splits32 # full-size: ours with vLLM's 32 decode splits in graphs
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-normvllm # full-size: ours with vLLM's (Inductor's) norms
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-kdanormvllm # full-size: ours with vLLM's KDA output norm
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh ours-splits64 # full-size: ours with 64 MLA decode splits
#   WITH_TESTS="scripted trap" ... ours|upstream|ours-mtp|ours-dspark|ours-flashmla|ours-kdavllm|ours-splits32|ours-normvllm|ours-kdanormvllm|ours-splits64
#                                   # those tiny end-to-end tests beside it first
#   LAYERS=6 TREE_COMMIT=<sha> bash scripts/h200_session.sh slices  # A/B of each switch on a 6-layer slice
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh cuts   # the decode-step cuts' GPU tests (each cut that fails
#                                                         # is switched off in the later phases), router bench;
#                                                         # WITH_TESTS="dspark" runs tiny tests beside them
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh kda-bench # the KDA decode benchmark (cuts runs it unless CUTS_KDA_BENCH=0)
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh gate-bench # the router gate at prefill sizes (kernel-only)
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh router-bench # the router top-k kernels (kernel-only); a winning candidate serves the later phases
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh mla-splits   # FlashAttention 3's MLA decode by split bound (kernel-only)
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh router-step  # the router between its real neighbours (kernel-only)
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh norm-chain   # the residual norms and the KDA output norm between
#                                                               # their real neighbours, and their kernel tests
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh dense-bench # the widest dense FP8 linears at 8-16 rows (kernel-only)
#   TREE_COMMIT=<sha> bash scripts/h200_session.sh short      # one call: the tiny essentials beside ours,
#                                                             # then upstream (a lease's last ten minutes)
#
# One full-size server per call (65 GiB of weights leave an 80 GB H100 room for one); each part has its
# own time limit inside the 10-minute call, so what finished comes back. Run the phases back to back on
# one machine (it is given back 30 s after a call): later starts reuse the Inductor cache that way.
set -u
phase=${1:?phase}
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
: "${OUT:?OUT}"
commit=${TREE_COMMIT:-}
# everything here; one archive back to $OUT at the end (the device returns 8 files). `tests` with WITH_TESTS
# (a chosen few, e.g. "tests:dspark" first and the whole list later in one job) gets a folder of its own
run_id=$phase
[ "$phase" = tests ] && [ -n "${WITH_TESTS:-}" ] && run_id=tests-${WITH_TESTS// /-}
out=/tmp/gpu-run-$run_id
rm -rf "$out" && mkdir -p "$out/logs"
# The device bundle (../shared/tools/device-vllm.sh) has no torchvision for torch 2.13 (vLLM's GPU wheel
# depends on it, so users have it): vLLM 0.32's kernel warm-up imports its MiniMax-M3 warm-up module,
# which imports torchvision, for every model. On this device only, that module is replaced by a no-op
# (Ling has no MiniMax-M3 layer); a torchvision stub instead makes transformers import torchvision.io.
# Better, vLLM's own pin carried beside the bundle (a second warm-up, Qwen-VL's, imports it through
# transformers too): `pip download --no-deps torchvision==0.28.0 -d .gpuvllm/tv` here, carried.
ls .gpuvllm/tv/torchvision-*.whl >/dev/null 2>&1 && ! python3 -c "import torchvision" 2>/dev/null &&
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpuvllm/tv/*.whl
python3 -c "import torchvision" 2>/dev/null ||
  printf 'def minimax_m3_msa_warmup(*args, **kwargs):\n    return None\n' \
    > /tmp/site/vllm/model_executor/warmup/minimax_m3_msa_warmup.py
# Nor has it FlashInfer's prebuilt kernels (flashinfer-cubin): vLLM's FlashInfer block-scale FP8 GEMM
# would JIT-build with nvcc inside the first start (minutes; it ran out a start-up limit in the last
# lease). Off here: vLLM then picks DeepGEMM (loaded) or CUTLASS (DeepGEMM off) for block FP8.
export VLLM_BLOCKSCALE_FP8_GEMM_FLASHINFER=0
# Likewise its sampling kernels: vLLM's warm-up samples, and FlashInfer's top-k/top-p sampler JIT-built
# for minutes there (a fresh full-size start ran out of its 480 s in that build). The benchmarks and
# tests decode greedily; vLLM's PyTorch sampler serves them the same.
export VLLM_USE_FLASHINFER_SAMPLER=0
# vLLM's warm-up steps before the graph capture took 84-144 s in every full-size start so far, the second
# start of a lease too (serve_h200's "warm-up steps"). A likely part: the vendored fla KDA kernels'
# triton.autotune (compile and time every config at first use). vLLM keeps Triton's cache beside each
# model's compile cache (compiler_interface.initialize_cache), so each composition, and each tiny test
# process with its own VLLM_CACHE_ROOT, rebuilt the same kernels, and autotune results are not kept at
# all by default. Here one cache serves every server of the lease (carried to the next with the others)
# and keeps the autotune results: the next lease's warm-up column says what that saves.
export TRITON_CACHE_DIR=${TRITON_CACHE_DIR:-/root/.triton/cache} TRITON_CACHE_AUTOTUNING=1
# Servers run in their own sessions, which outlive a command stopped at its limit: whatever holds the
# GPU when a phase begins or ends is from this session's earlier work, and goes; so does every
# process of a server started here (they carry vllm_ling.processes' marker in their environment;
# a word in a command line would also match whatever runs from a checkout named vllm-ling).
free_gpu() {
  nvidia-smi --query-compute-apps=pid --format=csv,noheader 2>/dev/null | xargs -r kill -9 2>/dev/null
  grep -lz '^_VLLM_LING_SERVER=' /proc/[0-9]*/environ 2>/dev/null | cut -d/ -f3 | grep -vx "$$" |
    xargs -r kill -9 2>/dev/null
  sleep 2
}
free_gpu
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__, torch.cuda.get_device_name())" \
  > "$out/versions.txt" 2>&1
record() {  # suite, pytest log: a verified.csv row (brought back in run.tgz) from pytest's summary line
  local summary
  # pytest -q prints its summary bare ("1 passed in 197.21s"), without the === rule
  summary=$(grep -E '^(=+ )?[0-9]+ (passed|failed|error|skipped|deselected).* in [0-9.]+s' "$2" | tail -n 1 |
            sed -E 's/^=+ //; s/ =+$//')
  python3 scripts/record_verified.py --suite "$1" --result "${summary:-no summary (stopped)}" \
    --file "$out/verified.csv" ${commit:+--commit "$commit"}
}
e2e=tests/deploy/test_serve_gpu_e2e.py
# A full-size server's settings, every phase alike: a fixed KV cache (one 32K request fits) and
# 2048-token prefill chunks; the start check's share stays small (the cache is not profiled).
full_size=(--logs "$out/logs" --gpu-memory-utilization 0.5 --kv-cache-gib 4
           --vllm-arg=--max-num-batched-tokens --vllm-arg=2048)
pids=()
suite_of() { case "$1" in kernels-*|moe-clamp) echo "gpu:$1" ;; *) echo "gpu-e2e:$1" ;; esac; }
record_tiny() {  # tiny test names (as tiny_test takes them): a verified.csv row for each process they ran
  local name
  for name in ${1/demo/}; do
    if [ "$name" = cuts-sets ]; then
      for set in kda_decode_off router_topk_only kda_fused_conv_only neither; do
        record "gpu-e2e:cuts-$set" "$out/cuts-$set.log"
      done
      continue
    fi
    record "$(suite_of "$name")" "$out/$name.log"
    [ "$name" = dspark ] && record gpu-e2e:dspark-parsers "$out/dspark-parsers.log"
  done
}
tiny_test() {  # name, time limit (s): one tiny end-to-end test of $e2e by its short name
  local name=$1 limit=$2
  case "$name" in
  scripted) VLLM_DEEP_GEMM_WARMUP=skip part scripted "$limit" "$e2e::test_scripted_checkpoint_with_mtp_and_parsers_on_cuda_graphs" ;;
  trap) VLLM_DEEP_GEMM_WARMUP=skip part trap "$limit" "$e2e::test_weight_only_head_trap_is_refused_on_the_gpu" ;;
  # DeepGEMM loaded in all of them; its JIT warm-up over every M (1105 shapes, 1-2 s each beside a
  # full-size compile) ran the agreeing test out of its limit in the last lease, so it is skipped.
  agreeing) VLLM_DEEP_GEMM_WARMUP=skip part agreeing "$limit" "$e2e::test_agreeing_checkpoint_accepts_its_drafts_and_answers_right" ;;
  greedy-off) VLLM_DEEP_GEMM_WARMUP=skip part greedy-off "$limit" "$e2e" -k "greedy and spec_off" ;;
  greedy-eager) VLLM_DEEP_GEMM_WARMUP=skip part greedy-eager "$limit" "$e2e" -k "greedy and eager_mode" ;;
  opt-out-each) VLLM_DEEP_GEMM_WARMUP=skip part opt-out-each "$limit" "$e2e" -k "each_opt_out_alone" ;;
  opt-out-all) VLLM_DEEP_GEMM_WARMUP=skip part opt-out-all "$limit" "$e2e" -k "every_opt_out_at_once" ;;
  # two servers one after the other took more than 320 s in lease 2026-12-06c: one process each
  dspark) VLLM_DEEP_GEMM_WARMUP=skip part dspark "$limit" "$e2e::test_dspark_agreeing_drafter_end_to_end"
          VLLM_DEEP_GEMM_WARMUP=skip part dspark-parsers "$limit" "$e2e::test_dspark_keeps_tool_calls_and_reasoning_parsed" ;;
  # issue 29's decode cuts served together on the routable tiny model; cuts-bisect: without the newest cut
  # (the one-launch KDA decode) and with none, side by side (after cuts-e2e, from the kernels it built), to
  # name the cut at fault (the router top-k and the fused convolutions passed together in lease 06f)
  cuts-e2e) VLLM_DEEP_GEMM_WARMUP=skip part cuts-e2e "$limit" "$e2e" -k "decode_cuts and every_cut" ;;
  # the other four cut sets of the parametrized test (make test-gpu runs all five), one process each
  cuts-sets) for set in kda_decode_off router_topk_only kda_fused_conv_only neither; do
               VLLM_DEEP_GEMM_WARMUP=skip part "cuts-$set" "$limit" "$e2e" -k "decode_cuts and $set"
             done ;;
  cuts-bisect) for set in kda_decode_off neither; do
                 VLLM_DEEP_GEMM_WARMUP=skip part "cuts-$set" "$limit" "$e2e" -k "decode_cuts and $set"
               done ;;
  kernels-a) part kernels-a "$limit" -m gpu tests/ops/dense_fp8 tests/ops/small_gemv tests/ops/test_router_known_answer_gpu.py \
    tests/ops/test_known_answer_gpu.py tests/ops/test_router_topk_gpu.py ;;
  kernels-b) part kernels-b "$limit" -m gpu tests/ops/moe tests/ops/lm_head tests/ops/test_humming_jit.py tests/benchmarks ;;
  # the served layers' GPU tests (router top-k, fused conv, MoE routing) and the one-launch KDA decode
  kernels-c) part kernels-c "$limit" -m gpu tests/layers tests/ops/test_kda_decode.py tests/models/test_shared_swiglu.py \
    tests/ops/residual_norm ;;
  # the routed-expert clamp mode (issue 43): the MoE kernels and known answers that tell the modes apart
  moe-clamp) part moe-clamp "$limit" -m gpu tests/ops/test_known_answer_gpu.py tests/ops/moe \
    tests/benchmarks/test_decode_standins.py tests/layers/test_moe_routing_gpu.py ;;
  demo) (VLLM_DEEP_GEMM_WARMUP=skip timeout "$limit" python3 -m vllm_ling.cli.demo --out "$out/demo" > "$out/demo.log" 2>&1
         echo "demo rc $?" >> "$out/rc.txt") &
        pids+=($!) ;;
  *) echo "unknown tiny test $name" >&2 ;;
  esac
}
abort_stalled() {  # path: the servers whose launcher's command line holds it write their stacks to their logs
  # (vllm_ling.launcher.local_server.abort_with_stacks: youngest process first), before free_gpu takes them
  local markers
  markers=$(for e in $(grep -lz '^_VLLM_LING_SERVER=' /proc/[0-9]*/environ 2>/dev/null); do
              tr '\0' ' ' < "${e%/environ}/cmdline" 2>/dev/null | grep -qF "$1" &&
                tr '\0' '\n' < "$e" | sed -n 's/^_VLLM_LING_SERVER=//p'
            done | sort -u)
  [ -n "$markers" ] && python3 -c "import sys
from vllm_ling.launcher.local_server import abort_with_stacks
for m in sys.argv[1:]: abort_with_stacks(m)" $markers
}
# a pytest log's summary line: passed (nothing failed), or failed (a failure counted, not a time-out)
passed() { [ -e "$1" ] && grep -qE '^[0-9]+ passed' "$1" && ! grep -qE '^[0-9]+ (failed|error)' "$1"; }
failed() { [ -e "$1" ] && grep -qE '^[0-9]+ (failed|error)' "$1"; }
cuts_off() {  # cut (kda_decode, router_topk, residual_norm, kda_output_norm): why a later phase serves it off
  local dir=/tmp/gpu-run-cuts cut=$1   # after phase cuts (or norm-chain, for the norms) ran its kernel tests (empty: on)
  case "$cut" in residual_norm|kda_output_norm) dir=/tmp/gpu-run-norm-chain ;; esac
  local log="$dir/${cut//_/-}.log"  # its kernel tests' part: kda-decode, router-topk, residual-norm, kda-output-norm
  if [ -e "$log" ] && ! passed "$log"; then echo "its kernel tests did not pass"; return; fi
  [ "$cut" = kda_decode ] || return 0
  if [ ! -e "$dir/cuts-e2e.log" ] || passed "$dir/cuts-e2e.log"; then return; fi
  # every cut together failed: the bisect's servers say whether without this one it passes
  if passed "$dir/cuts-kda_decode_off.log"; then
    echo "the tiny server with every cut failed and the one without $cut passed"
  fi  # else not this cut's failure alone (the earlier cuts, or the server, failed too)
}
bench() {  # name, time limit (s), benchmarks module, its arguments...: its table to $OUT/<name>.md, its log here
  local name=$1 limit=$2 module=$3; shift 3
  timeout "$limit" python3 -m "benchmarks.$module" --out "$OUT/$name.md" "$@" > "$out/$name.txt" 2>&1
  echo "$name rc $?" >> "$out/rc.txt"
}
part() {  # name, time limit (s), pytest arguments...: one pytest process in the background
  local name=$1 limit=$2; shift 2
  (timeout "$limit" python3 -m pytest -q -rA -p no:cacheprovider --basetemp "$out/pt-$name" "$@" > "$out/$name.log" 2>&1
   rc=$?
   # out of time: the stacks of a server still starting say where (lease 2026-12-06d: three tiny starts
   # beside each other ran out of 420 s with their logs silent for minutes)
   [ "$rc" = 124 ] && abort_stalled "$out/pt-$name/"
   echo "$name rc $rc" >> "$out/rc.txt") &
  pids+=($!)
}
router_tests() {  # the router kernels' GPU tests, two parts: the served top-k's (router-topk) and the candidate's
  # (kernel.py's CANDIDATE_VARIANT, ranks) apart, so a candidate's failure never switches the served kernel off
  # (cuts_off reads router-topk.log only) and the candidate is judged on its own tests
  part router-topk 300 -m gpu tests/ops/test_router_topk_gpu.py tests/layers/test_router_topk.py -k "not ranks and not candidate"
  part router-topk-candidate 300 -m gpu tests/ops/test_router_topk_gpu.py -k "ranks or candidate"
}
serve_winning_topk_candidate() {  # rows JSON of benchmarks/router_topk.py
  # The candidate router top-k serves this lease's later phases (in the lease's copy of the tree, which
  # they import) where it passed its GPU tests and the benchmark found it right and faster at every decode
  # size: its known-answer check runs at every start, and the ours profile names the kernel that served.
  # The repository's SERVED_VARIANT changes only by a commit, after reading the numbers.
  local why
  if passed "$out/router-topk-candidate.log" && passed "$out/router-topk.log" &&
     why=$(python3 -m benchmarks.router_topk --candidate-wins "$1" 2>&1); then
    sed -i 's/^SERVED_VARIANT = "rounds"$/SERVED_VARIANT = "ranks"/' vllm_ling/ops/router_topk/kernel.py
    grep -q '^SERVED_VARIANT = "ranks"$' vllm_ling/ops/router_topk/kernel.py &&
      echo "router-topk: ranks serves the later phases ($why)" >> "$out/rc.txt"
  else
    echo "router-topk: rounds serves (${why:-the kernel tests did not both pass})" >> "$out/rc.txt"
  fi
}
kda_bench() {  # the KDA decode benchmark; its launch table serves the later phases where phase cuts' kernel tests passed
  # (420 s: DSpark's 9-token windows and each window on the kernel's other path joined the cases)
  local rc
  timeout 420 python3 -m benchmarks.kda_decode --out "$OUT/kda-decode.md" --launch-table "$OUT/kda_decode_launch.json" \
    > "$out/kda-decode-bench.txt" 2>&1
  rc=$?
  echo "kda-decode-bench rc $rc" >> "$out/rc.txt"
  # Likewise the KDA decode kernel's launch table: the benchmark's fastest configuration per batch serves this
  # lease's later phases (every configuration it times passed the kernel's GPU tests in phase cuts); the
  # repository's vllm_ling/data/kda_decode_launch.json changes by a commit of the lease's table
  if [ "$rc" = 0 ] && passed /tmp/gpu-run-cuts/kda-decode.log && [ -s "$OUT/kda_decode_launch.json" ]; then
    cp "$OUT/kda_decode_launch.json" vllm_ling/data/kda_decode_launch.json &&
      echo "kda-decode: this lease's launch table serves the later phases" >> "$out/rc.txt"
  fi
}
case "$phase" in
tests)
  # Tiny models compile in seconds: one Inductor worker per server keeps 15 servers' host memory small.
  # DeepGEMM stays loaded (vLLM's default); its JIT warm-up over every M is skipped (the few sizes a
  # tiny server runs JIT on first use).
  export TORCHINDUCTOR_COMPILE_THREADS=1
  # opt-out-each (one server per switch, 15, started together; it never finished beside the other
  # servers or last in a lease) goes first, with only the kernel suites beside it (host memory: 15 servers'
  # processes); then the other servers, TESTS_AT_ONCE (3) processes at a time, the most wanted first: all
  # at once, the servers only slow each other down (lease 2026-12-06d: three tiny servers beside two kernel
  # suites all ran out of 420 s in vLLM's warm-up steps on a cold device); the later ones start from the
  # Triton kernels the first ones built. TEST_S (540): each of those processes' limit; KERNEL_S (900) the
  # kernel suites' (lease 2026-12-07f: beside the 15 servers kernels-a took 528 s, 318 alone; b and c ran out of 720)
  # WITH_TESTS ("tests:dspark" in a lease): those names only; else the whole gpu suite (make test-gpu's
  # set: every test of the gpu marker, the five cut sets included) and make demo's program
  at_once=${TESTS_AT_ONCE:-3}
  names=${WITH_TESTS:-opt-out-each kernels-a kernels-b kernels-c scripted agreeing dspark greedy-off greedy-eager opt-out-all trap cuts-e2e cuts-sets demo}
  first=()
  case " $names " in *" opt-out-each "*) tiny_test opt-out-each 900; first=("${pids[-1]}") ;; esac
  for name in $names; do
    case "$name" in opt-out-each) continue ;; kernels-*) ;; *) [ "${#first[@]}" -gt 0 ] && { wait "${first[@]}"; first=(); } ;; esac
    while [ "$(jobs -rp | wc -l)" -ge "$at_once" ]; do wait -n; done
    case "$name" in kernels-*) tiny_test "$name" "${KERNEL_S:-900}" ;; *) tiny_test "$name" "${TEST_S:-540}" ;; esac
  done
  [ "${#pids[@]}" -gt 0 ] && wait "${pids[@]}"
  record_tiny "$names"
  ;;
ours|upstream|ours-mtp|ours-dspark|ours-flashmla|ours-kdavllm|ours-splits32|ours-normvllm|ours-kdanormvllm|ours-splits64)
  # WITH_TESTS="scripted trap ...": those tiny end-to-end tests (names as in tiny_test) run beside the
  # full-size start, which measures only once they are done (the timings stay that server's own).
  # STARTUP_S (480) and TINY_S (420): the start-up and beside-test limits; scripts/h200_lease.sh, whose
  # phases outlive a call, raises them for a fresh machine's JIT builds. A start whose log stays silent
  # for 300 s (serve_h200 --stall-timeout) is stopped early with its stacks, freeing the lease's minutes.
  startup_s=${STARTUP_S:-480} tiny_s=${TINY_S:-420}
  wait_for=()
  if [ -n "${WITH_TESTS:-}" ]; then
    quiet=/tmp/gpu-quiet-$phase
    (export TORCHINDUCTOR_COMPILE_THREADS=1
     for name in $WITH_TESTS; do tiny_test "$name" "$tiny_s"; done
     wait "${pids[@]}"; touch "$quiet"
     record_tiny "$WITH_TESTS") &
    tiny=$!
    wait_for=(--wait-for "$quiet" --wait-for-s "$tiny_s")
  fi
  # vLLM's block-FP8 GEMM (the prefill path; the upstream composition's decode path too) without
  # DeepGEMM: CUTLASS on the upcast scales, the path a DGX Spark (sm_121, no DeepGEMM) takes, and no
  # DeepGEMM JIT warm-up in the start-up.
  composition=(--composition "${phase%-*}")
  [ "$phase" = ours-mtp ] && composition+=(--mtp)
  # PROFILE=1: vLLM's torch profiler over named prefill and decode windows after the measurements
  # (benchmarks/vllm_profile.py; the compact traces come back with the phase's output)
  [ "${PROFILE:-0}" = 1 ] && composition+=(--profile-dir "$OUT/prof-$phase${LAYERS:+-L$LAYERS}")
  # PROFILE_PREFILLS=64,2048: fewer profiled prefills (a 32K window's trace takes minutes to compact)
  [ "${PROFILE:-0}" = 1 ] && [ -n "${PROFILE_PREFILLS:-}" ] && composition+=(--profile-prefills "$PROFILE_PREFILLS")
  [ "$phase" = ours-dspark ] && composition+=(--dspark)
  # issue 29's MLA decode candidate at full size (a slice's TPOT is host-paced): vLLM picks FlashAttention 3
  # for MLA decode on sm_90 (the real step's 0.30 ms at 32K, 3.5x its floor); FlashMLA against ours' TPOT
  # (vLLM's per-KV-group override: the MLA layers only, as a DSpark drafter's MHA layers would need)
  [ "$phase" = ours-flashmla ] &&
    composition+=('--vllm-arg=--attention-config={"backend_per_kind":{"mla_attention":"FLASHMLA"}}' --tag flashmla)
  # the one-launch KDA decode against vLLM's three kernels served, back to back with ours (lease 2026-12-07b:
  # vLLM's took 8.5 us per layer in the real step, which the benchmark times at 14.0)
  [ "$phase" = ours-kdavllm ] && composition+=(--switch VLLM_LING_KDA_DECODE=0)
  # issue 29's MLA decode cut against vLLM's bound (32 splits: 32 CTAs read a batch-1 decode's latent cache)
  [ "$phase" = ours-splits32 ] && composition+=(--switch VLLM_LING_DECODE_SPLITS=0)
  # the bound the kernel table favours (lease 2026-12-07h: 30.9 us per MLA layer at 32K and one token against
  # 33.2 at 128, 72 against 76 at 128K) against the default 128, back to back with ours
  [ "$phase" = ours-splits64 ] && composition+=(--switch VLLM_LING_DECODE_SPLITS=64)
  # issue 29's norms against Inductor's (vLLM's default under torch.compile), back to back with ours
  [ "$phase" = ours-normvllm ] && composition+=(--switch VLLM_LING_RESIDUAL_NORM=vllm)
  # issue 29's KDA output norm inside the decode launch against vLLM's norm kernel after it, back to back with ours
  [ "$phase" = ours-kdanormvllm ] && composition+=(--switch VLLM_LING_KDA_OUTPUT_NORM=0)
  # a decode-step cut (default on, never served on a GPU before) that did not pass its GPU tests earlier
  # in this lease (phase cuts) is served off (cuts_off), rather than lose the phase to it
  [ "$phase" != upstream ] && for cut in kda_decode:VLLM_LING_KDA_DECODE=0 router_topk:VLLM_LING_ROUTER_TOPK=vllm \
                                         residual_norm:VLLM_LING_RESIDUAL_NORM=vllm \
                                         kda_output_norm:VLLM_LING_KDA_OUTPUT_NORM=0; do
    why=$(cuts_off "${cut%%:*}")
    [ -n "$why" ] && composition+=(--switch "${cut#*:}") && echo "$phase: ${cut#*:} ($why)" >> "$out/rc.txt"
  done
  # LAYERS=N: a full-width slice of N decoder layers (benchmarks/serve_h200.py --layers): starts in a
  # fraction of the full size's time, for A/B runs of one switch; its JSON is <phase>-L<N>.json
  run=$phase
  [ -n "${LAYERS:-}" ] && composition+=(--layers "$LAYERS") && run=$phase-L$LAYERS
  # the SM and memory clocks and the power every 200 ms while it runs (clocks-<run>.csv beside its JSON): whether
  # the step's latency-bound kernels run below the boost clock their microbenchmarks see
  nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,utilization.gpu --format=csv -lms 200 \
    > "$OUT/clocks-$run.csv" 2>/dev/null &
  clocks=$!
  VLLM_USE_DEEP_GEMM=0 timeout $((startup_s + 80)) python3 -m benchmarks.serve_h200 run "${composition[@]}" \
    --json "$OUT/$run.json" "${full_size[@]}" --startup-timeout "$startup_s" "${wait_for[@]}" > "$out/$phase.txt" 2>&1
  echo "$phase rc $?" >> "$out/rc.txt"
  kill "$clocks" 2>/dev/null
  [ -n "${WITH_TESTS:-}" ] && wait $tiny
  ;;
slices)
  # A/B of one switch at a time on a LAYERS-layer (default 6) full-width slice, one server after another:
  # SLICES="name:VAR=value ..." (default: ours, ours with each prefill-time switch and each decode cut at its
  # opt-out, ours on FlashMLA, and the upstream composition; `name:--vllm-flag=value` passes a vLLM argument instead, e.g.
  # flashmla:--attention-backend=FLASHMLA); each gets STARTUP_S (default 330: a slice compiles in ~30 s
  # but captures every graph size), short measurements, its JSON slice-<name>-L<n>.json and its own
  # server log folder. A slice's TPOT is host-paced (lease 2026-12-06e: 1.2-3.5 ms per token, run to run,
  # for 0.6 ms of GPU work): it tells prefill-time switches (TTFT) and start-ups apart, not decode cuts.
  n=${LAYERS:-6} startup_s=${STARTUP_S:-330}
  for spec in ${SLICES:-ours: graphs0:VLLM_LING_PREFILL_GRAPH_TOKENS=0 routing-torch:VLLM_LING_MOE_ROUTING=torch kda0:VLLM_LING_KDA_MERGED_IN_PROJ=0 dense-vllm:VLLM_LING_DENSE_FP8=vllm topk-vllm:VLLM_LING_ROUTER_TOPK=vllm conv0:VLLM_LING_KDA_FUSED_CONV=0 kdadecode0:VLLM_LING_KDA_DECODE=0 flashmla:--attention-backend=FLASHMLA upstream:}; do
    name=${spec%%:*} setting=${spec#*:} comp=ours ab=()
    [ "$name" = upstream ] && comp=upstream
    case "$setting" in
    "") ;;
    --*) ab=(--vllm-arg="$setting" --tag "$name") ;;
    *) ab=(--switch "$setting") ;;
    esac
    VLLM_USE_DEEP_GEMM=0 timeout $((startup_s + 150)) python3 -m benchmarks.serve_h200 run \
      --composition "$comp" "${ab[@]}" --layers "$n" --json "$OUT/slice-$name-L$n.json" "${full_size[@]}" --logs "$out/logs-$name" \
      --startup-timeout "$startup_s" --repeats 2 --long-repeats 1 --tokens 64 --long-tokens 16 > "$out/slice-$name.txt" 2>&1
    echo "slice-$name rc $?" >> "$out/rc.txt"
    free_gpu
  done
  ;;
cuts)
  # Issue 29's cuts on an idle GPU, before any full-size start: each one's kernel and served-layer tests
  # (the ours* phases switch a failed one off), then the grouped top-k against vLLM's
  # grouped_topk_fused_kernel (benchmarks/router_topk.py; kernel-only, minutes)
  # CUTS_ROUTER=0: not the router top-k's tests and benchmark (measured in six leases; "rounds" serves)
  if [ "${CUTS_ROUTER:-1}" = 1 ]; then
    router_tests
  fi
  part kda-conv 300 -m gpu tests/layers/test_kda_fused_conv.py
  # the kernel's own tests only: in lease 2026-12-07b the benchmark's smoke test (which the benchmark below
  # runs in full anyway) took the part past its limit after both kernel tests passed, and so switched the
  # cut off for the lease
  part kda-decode 420 -m gpu tests/ops/test_kda_decode.py
  # both cuts through torch.compile and CUDA graphs on the routable tiny model (alone, prefill graphs to
  # 128 tokens: about 6 minutes on a fresh device); where it fails, each cut alone and neither, side by
  # side from the kernels it built (cuts_off reads them for the later phases). CUTS_QUICK=1: the kernel
  # tests and the two benchmarks only (3-4 minutes; a short lease keeps its full-size phases)
  if [ "${CUTS_QUICK:-0}" != 1 ]; then
    tiny_test cuts-e2e 480
    wait "${pids[@]}"; pids=()
    passed "$out/cuts-e2e.log" || tiny_test cuts-bisect 420
  fi
  # WITH_TESTS="dspark ...": tiny end-to-end tests beside them (the GPU holds no full-size server yet). Not
  # free: in lease 2026-12-06d cuts-e2e, dspark and dspark-parsers started together all ran out of 420 s
  # (each built the same Triton kernels then; TRITON_CACHE_DIR above now shares them)
  for name in ${WITH_TESTS:-}; do tiny_test "$name" 540; done
  wait "${pids[@]}"
  [ -e "$out/router-topk.log" ] && record gpu:router-topk "$out/router-topk.log"
  [ -e "$out/router-topk-candidate.log" ] && record gpu:router-topk-candidate "$out/router-topk-candidate.log"
  record gpu:kda-conv "$out/kda-conv.log"
  record gpu:kda-decode "$out/kda-decode.log"
  [ -e "$out/cuts-e2e.log" ] && record gpu-e2e:cuts "$out/cuts-e2e.log"
  for set in kda_decode_off neither; do
    [ -e "$out/cuts-$set.log" ] && record "gpu-e2e:cuts-$set" "$out/cuts-$set.log"
  done
  record_tiny "${WITH_TESTS:-}"
  if [ "${CUTS_ROUTER:-1}" = 1 ]; then
    timeout 200 python3 -m benchmarks.router_topk --out "$OUT/router-topk.md" --json "$out/router-topk.json" \
      > "$out/router-topk-bench.txt" 2>&1
    echo "router-topk-bench rc $?" >> "$out/rc.txt"
  fi
  serve_winning_topk_candidate "$out/router-topk.json"
  # CUTS_KDA_BENCH=0: the KDA benchmark later, as its own phase kda-bench (a short lease's full-size phases first)
  [ "${CUTS_KDA_BENCH:-1}" = 1 ] && kda_bench
  ;;
kda-bench)
  kda_bench
  ;;
router-bench)
  # The router on an idle GPU (no server, a few minutes): the top-k kernels' GPU tests, then
  # benchmarks/router_topk.py (the top-k kernels against vLLM's)
  router_tests
  wait "${pids[@]}"
  for name in router-topk router-topk-candidate; do record "gpu:$name" "$out/$name.log"; done
  timeout 300 python3 -m benchmarks.router_topk --tokens 1,2,4,16,256 --out "$OUT/router-topk.md" \
    --json "$OUT/router-topk.json" > "$out/router-topk-bench.txt" 2>&1
  echo "router-topk-bench rc $?" >> "$out/rc.txt"
  serve_winning_topk_candidate "$OUT/router-topk.json"
  ;;
router-step)
  # The router between its real neighbours on an idle GPU (kernel-only, a few minutes: 8 MoE layers of experts
  # are built): GEMV -> top-k -> routed experts against the chain without the top-k (benchmarks/router_in_step.py)
  bench router-in-step 420 router_in_step
  ;;
norm-chain)
  # Issue 29's norms on an idle GPU (kernel-only, a minute or two): residual add + RMSNorm as Inductor compiles it
  # and as vllm-ling's kernel, each before the linear it feeds, against the linears alone (benchmarks/norm_in_chain.py),
  # and the kernel's GPU tests
  bench norm-in-chain 300 norm_in_chain
  timeout 240 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/residual_norm > "$out/residual-norm.log" 2>&1
  echo "residual-norm tests rc $?" >> "$out/rc.txt"  # a later phase serves the norm off where they failed (cuts_off)
  # the KDA output norm inside the one-launch decode: one KDA layer's launch -> norm -> out-projection over 8 layers
  # (benchmarks/kda_norm_in_chain.py), and its GPU tests (a later phase serves it off where they failed)
  bench kda-norm-in-chain 300 kda_norm_in_chain
  timeout 300 python3 -m pytest -q -m gpu -p no:cacheprovider tests/ops/test_kda_decode.py -k output_norm \
    > "$out/kda-output-norm.log" 2>&1
  echo "kda-output-norm tests rc $?" >> "$out/rc.txt"
  record gpu:residual-norm "$out/residual-norm.log"
  record gpu:kda-output-norm "$out/kda-output-norm.log"
  ;;
mla-splits)
  # Issue 29's MLA decode on an idle GPU (kernel-only, a minute or two): FlashAttention 3 at Ling's shape against
  # its split bound, vLLM's 32 in CUDA graphs against VLLM_LING_DECODE_SPLITS' 64/128 and its own choice, one
  # token and the 4-token verify window, 4K to 128K of context (benchmarks/mla_decode_splits.py)
  bench mla-decode-splits 420 mla_decode_splits
  ;;
gate-bench)
  # The MoE router gate at prefill sizes on an idle GPU (kernel-only, about a minute): vLLM's fp32 SIMT path
  # against the fp32 weight as BF16 parts through one tensor-core GEMM (benchmarks/router_gate_prefill.py)
  bench router-gate-prefill 300 router_gate_prefill
  ;;
dense-bench)
  # The dense block-FP8 linears at the row counts around W8A16_MAX_ROWS's limit of 8 on the two widest weights
  # (kernel-only, a minute or two): DSpark's 9-row verify sends them to vLLM's CUTLASS W8A8 (26.7 us each in
  # lease 2026-12-07d's step); dense_fp8_h200.md has ours 1.21x faster at 8 rows, 0.95x at 16, nothing between
  timeout 300 python3 -m benchmarks.dense_fp8 --rows 8 9 12 16 --shapes 20480x2560 12288x2560 \
    --out "$OUT/dense-fp8-rows.md" > "$out/dense-fp8-rows.txt" 2>&1
  echo "dense-fp8-rows rc $?" >> "$out/rc.txt"
  ;;
moe-bench)
  # Issue 43 on an idle GPU: the clamp-mode kernel tests, then one MoE layer, decode kernels vs humming's
  # GEMM, without a limit (comparable to benchmarks/results/moe_decode_h200.md) and at Ling's limit 4
  # in each clamp mode
  tiny_test moe-clamp 300
  wait "${pids[@]}"
  record gpu:moe-clamp "$out/moe-clamp.log"
  for run in "plain::" "limit4-after:--swiglu-limit 4:" "limit4-before:--swiglu-limit 4 --clamp gate_input:"; do
    IFS=: read -r name flags _ <<< "$run"
    timeout 200 python3 -m benchmarks.moe_decode --tokens 1,4,16 --variants default --hl-variants default $flags \
      --out "$OUT/moe-bench-$name.md" > "$out/moe-bench-$name.txt" 2>&1
    echo "moe-bench-$name rc $?" >> "$out/rc.txt"
  done
  ;;
short)
  # One lease's last ten minutes: the tiny end-to-end essentials beside the full-size start, then the
  # full-size measurements one server at a time (ours measures once the tiny servers are done).
  export TORCHINDUCTOR_COMPILE_THREADS=1
  quiet=/tmp/gpu-quiet-$$
  (for name in scripted agreeing greedy-off; do tiny_test "$name" 300; done
   wait "${pids[@]}"; touch "$quiet"
   record_tiny "scripted agreeing greedy-off") &
  tiny=$!
  start=$SECONDS
  (unset TORCHINDUCTOR_COMPILE_THREADS; export VLLM_USE_DEEP_GEMM=0
   timeout 330 python3 -m benchmarks.serve_h200 run --composition ours --json "$OUT/ours.json" "${full_size[@]}" \
     --startup-timeout 280 --wait-for "$quiet" --wait-for-s 200 > "$out/ours.txt" 2>&1
   echo "ours rc $?" >> "$out/rc.txt"
   left=$((560 - (SECONDS - start)))
   timeout "$left" python3 -m benchmarks.serve_h200 run --composition upstream --json "$OUT/upstream.json" \
     "${full_size[@]}" --startup-timeout $((left - 45)) --repeats 2 --long-repeats 1 > "$out/upstream.txt" 2>&1
   echo "upstream rc $?" >> "$out/rc.txt")
  wait $tiny
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
free_gpu
# server logs and reports of the tests, not their checkpoints
tar czf "$OUT/run-$run_id.tgz" -C "$out" --exclude='*.safetensors' --exclude='*.bin' . 2>/dev/null
cat "$out/rc.txt"
for f in "$out"/*.log; do echo "== $f"; grep -E "^(FAILED|ERROR)|passed|failed|error" "$f" | tail -n 6; done
for f in "$out"/*.txt; do echo "== $f"; tail -n 4 "$f"; done
