#!/usr/bin/env bash
# One command on the H200 device after `bash .gpuvllm/device-install.sh` (../shared/tools/device-vllm.sh):
# the GPU work of a lease in parallel, every log under $OUT (read after the call).
#
#   bash scripts/h200_session.sh serve-and-test   # full-size ours+MTP (measured once the rest is done),
#                                                 # the tiny GPU end-to-end tests, the gpu test suite
#   bash scripts/h200_session.sh measure          # full-size ours and upstream composition, one after
#                                                 # the other, then the table
#
# Each part has its own time limit inside the 10-minute call, so what finished comes back.
set -u
phase=${1:?phase}
export PYTHONPATH=/tmp/site PATH=/tmp/site/bin:$PATH PYTHONUNBUFFERED=1
: "${OUT:?OUT}"
out=/tmp/h200-run  # everything here; one archive back to $OUT at the end (the device returns 8 files)
rm -rf "$out" && mkdir -p "$out/logs"
# The device bundle (../shared/tools/device-vllm.sh) has no torchvision for torch 2.13 (vLLM's GPU wheel
# depends on it, so users have it): vLLM 0.32's kernel warm-up imports its MiniMax-M3 warm-up module,
# which imports torchvision, for every model. On this device only, that module is replaced by a no-op
# (Ling has no MiniMax-M3 layer); a torchvision stub instead makes transformers import torchvision.io.
python3 -c "import torchvision" 2>/dev/null ||
  printf 'def minimax_m3_msa_warmup(*args, **kwargs):\n    return None\n' \
    > /tmp/site/vllm/model_executor/warmup/minimax_m3_msa_warmup.py
nvidia-smi > "$out/nvidia-smi.txt" 2>&1
python3 -c "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)" > "$out/versions.txt" 2>&1
quiet=/tmp/vllm-ling-quiet
record() {  # suite, pytest log: a verified.csv row (brought back in run.tgz) from pytest's summary line
  local summary
  summary=$(grep -E '^=+ .*(passed|failed|error).* in [0-9.]+s' "$2" | tail -n 1 | sed -E 's/^=+ //; s/ =+$//')
  python3 scripts/record_verified.py --suite "$1" --result "${summary:-no summary (stopped)}" --file "$out/verified.csv"
}
case "$phase" in
serve-and-test)
  rm -f "$quiet"
  # the full-size server first: vLLM's start-up check wants its GPU share free
  timeout 560 python3 -m benchmarks.serve_h200 run --composition ours --mtp --json "$out/ours-mtp.json" \
    --logs "$out/logs" --wait-for "$quiet" --wait-for-s 450 > "$out/ours-mtp.txt" 2>&1 &
  fs=$!
  sleep 30
  # the tiny end-to-end tests in two processes (three servers each), and the rest of the gpu suite
  (timeout 420 python3 -m pytest -q -rA -m gpu tests/deploy/test_serve_gpu_e2e.py --basetemp "$out/pt-a" \
     -k "scripted or trap or accepts_its_drafts" > "$out/e2e-a.log" 2>&1; echo "e2e-a rc $?" >> "$out/rc.txt"
   record gpu-e2e "$out/e2e-a.log"
   # make demo's program with the GPU build (the install step needs a network)
   timeout 150 python3 -m vllm_ling.cli.demo --out "$out/demo" > "$out/demo.log" 2>&1
   echo "demo rc $?" >> "$out/rc.txt") &
  e2e_a=$!
  timeout 420 python3 -m pytest -q -rA -m gpu tests/deploy/test_serve_gpu_e2e.py --basetemp "$out/pt-b" \
    -k "greedy or opt_out" > "$out/e2e-b.log" 2>&1 &
  e2e_b=$!
  timeout 390 python3 -m pytest -q -rA -m gpu tests --ignore=tests/deploy/test_serve_gpu_e2e.py \
    --ignore=tests/deploy/test_helm_chart.py --ignore=tests/deploy/test_ray_two_nodes.py \
    --basetemp "$out/pt-suite" > "$out/gpu-suite.log" 2>&1
  echo "gpu suite rc $?" >> "$out/rc.txt"
  record gpu "$out/gpu-suite.log"
  wait $e2e_a
  wait $e2e_b; echo "e2e-b rc $?" >> "$out/rc.txt"
  record gpu-e2e "$out/e2e-b.log"
  touch "$quiet"
  wait $fs; echo "ours-mtp rc $?" >> "$out/rc.txt"
  ;;
measure)
  # both full-size servers start together (one compile each, in parallel) on a fixed small KV cache;
  # ours is measured once both are healthy, upstream once ours has stopped: one server busy at a time
  rm -f /tmp/h-ours /tmp/h-up /tmp/d-ours
  common=(--gpu-memory-utilization 0.44 --kv-cache-gib 1 --vllm-arg=--max-num-batched-tokens --vllm-arg=2048)
  timeout 520 python3 -m benchmarks.serve_h200 run --composition ours --json "$out/ours.json" --logs "$out/logs" \
    "${common[@]}" --healthy-file /tmp/h-ours --wait-for /tmp/h-up --wait-for-s 400 --done-file /tmp/d-ours \
    > "$out/ours.txt" 2>&1 &
  p1=$!
  sleep 20
  timeout 520 python3 -m benchmarks.serve_h200 run --composition upstream --json "$out/upstream.json" \
    --logs "$out/logs" "${common[@]}" --healthy-file /tmp/h-up --wait-for /tmp/d-ours --wait-for-s 480 \
    > "$out/upstream.txt" 2>&1 &
  p2=$!
  wait $p1; echo "ours rc $?" >> "$out/rc.txt"
  touch /tmp/d-ours
  wait $p2; echo "upstream rc $?" >> "$out/rc.txt"
  ;;
*) echo "unknown phase $phase" >&2; exit 2 ;;
esac
# server logs and reports of the tests, not their checkpoints
tar czf "$OUT/run.tgz" -C "$out" --exclude='*.safetensors' --exclude='*.bin' . 2>/dev/null
cp "$out"/*.json "$OUT"/ 2>/dev/null
cat "$out/rc.txt"
for f in "$out"/*.log; do echo "== $f"; grep -E "passed|failed|error" "$f" | tail -n 3; done
for f in "$out"/*.txt; do echo "== $f"; tail -n 4 "$f"; done
