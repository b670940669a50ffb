#!/usr/bin/env bash
# A whole GPU lease as one detached job: the phases of scripts/h200_session.sh run back to back in their
# own session, which outlives the device tool's 10-minute calls (the machine stays held while calls
# follow each other within 30 s), so a fresh machine's JIT builds need not fit one call.
#
#   bash scripts/h200_lease.sh start "ours:kernels-a kernels-b" "ours-mtp:scripted agreeing" upstream
#                                     # after device-install.sh: each PHASE[:WITH_TESTS] in order
#                                     # ("tests:dspark": only those of the gpu suite, "tests": all of it)
#   bash scripts/h200_lease.sh collect 560
#                                     # wait up to 560 s (or until the job ends), then bring back what
#                                     # finished (lease.tgz, the phases' JSON) and print the progress
#   bash scripts/h200_lease.sh quick 0 3
#                                     # the quick caches' parts 0-2 (collect brings them where it has room)
#
# STARTUP_S and TINY_S (default 900 and 600 here) are the phases' limits; PROFILE=1 profiles each
# full-size phase (scripts/h200_session.sh). After the phases the device's JIT/compile caches are packed;
# `caches FROM COUNT` brings back COUNT of their 15 MB parts per call; a later lease carries them
# (`tar -xzf` of the joined parts at / before the phases) to skip the rebuilds.
set -u
mode=${1:?mode}; shift
lease=/tmp/lease
# The caches that do not depend on our tree (Triton's kernels and autotune results, humming's kernels,
# FlashInfer's), packed after every phase as 15 MB parts quick/cache-NN: `collect` brings them back beside
# the results where the call's 8 files leave room, so a lease that ends mid-phase still returns them
# (the full pack below, vLLM's compile caches included, needs every phase done and calls of its own).
# Kept in .gpucache/ here, they come back in calls of their own as before; `start` restores them.
pack_quick() {
  local dirs
  dirs=$(cd / && ls -d root/.triton/cache root/.cache/vllm-ling root/.humming root/.cache/flashinfer 2>/dev/null)
  [ -n "$dirs" ] || return 0
  rm -rf "$lease/quick.new" && mkdir -p "$lease/quick.new"
  (cd / && tar cf - $dirs 2>/dev/null | gzip -1 | split -b 15000000 -d -a 2 - "$lease/quick.new/cache-")
  rm -rf "$lease/quick" && mv "$lease/quick.new" "$lease/quick"
}
case "$mode" in
start)
  rm -rf "$lease" && mkdir -p "$lease/out"
  # caches an earlier lease brought back (.gpucache/, git-excluded; 92 MB is more than one call carries, so
  # they come in calls of their own and are moved to /root/gc as the parts are to /root/gv): restored in place
  for d in /root/gc .gpucache .gpucache/quick-cache; do
    ls "$d"/cache-* >/dev/null 2>&1 && cat "$d"/cache-* | tar -xzf - -C / && echo "caches restored from $d" && break
  done
  # humming keys its kernels by its headers' mtimes, which this lease's install just set: back to those the
  # restored kernels recorded, or none of them hits (scripts/humming_cache_mtimes.py; before anything compiles)
  python3 scripts/humming_cache_mtimes.py /root/.cache/vllm-ling/humming/kernels /root/.humming/cache || true
  # a private copy: the device refreshes the working tree at every call, under a running job
  cp -a . "$lease/tree"
  setsid nohup bash "$lease/tree/scripts/h200_lease.sh" run "$@" > "$lease/driver.log" 2>&1 < /dev/null &
  echo "lease job started: $*"
  ;;
run)
  cd "$lease/tree"
  export STARTUP_S=${STARTUP_S:-900} TINY_S=${TINY_S:-600}
  # an 80 GB H100 holds one full-size server (65 GiB of weights) and nothing beside it
  mem_mib=$(nvidia-smi --query-gpu=memory.total --format=csv,noheader,nounits 2>/dev/null | head -n 1)
  for spec in "$@"; do
    phase=${spec%%:*}; tests=""; [ "$spec" != "$phase" ] && tests=${spec#*:}
    # (cuts and tests run tiny servers on an idle GPU: their WITH_TESTS are the tests themselves)
    if [ -n "$tests" ] && [ "$phase" != cuts ] && [ "$phase" != tests ] && [ "${mem_mib:-0}" -lt 100000 ]; then
      echo "$(date +%T) ${mem_mib} MiB of GPU memory: the tests beside $phase ($tests) are left out"; tests=""
    fi
    echo "$(date +%T) phase $phase (beside: ${tests:-none})"
    WITH_TESTS="$tests" OUT="$lease/out" bash scripts/h200_session.sh "$phase" > "$lease/phase-${spec//[: ]/-}.log" 2>&1
    echo "$(date +%T) phase $phase done"
    pack_quick
  done
  # the device's JIT and compile caches, measured and packed for the next lease
  # (root/.cache/vllm-ling: our humming kernel cache, 95 kernels and 52 s of a fresh full-size start)
  caches=$(cd / && ls -d root/.cache/vllm root/.cache/vllm-ling root/.triton/cache root/.humming root/.cache/flashinfer \
           tmp/torchinductor_root 2>/dev/null)
  (cd / && du -sh $caches) > "$lease/out/caches.txt" 2>&1
  (cd / && tar cf - $caches 2>/dev/null | gzip -1 | split -b 15000000 -d -a 2 - "$lease/cache-")
  ls -la "$lease"/cache-* >> "$lease/out/caches.txt" 2>&1
  touch "$lease/done"
  ;;
collect)
  wait_s=${1:-560}
  : "${OUT:?OUT}"
  end=$((SECONDS + wait_s))
  while [ ! -e "$lease/done" ] && [ "$SECONDS" -lt "$end" ]; do sleep 5; done
  cp "$lease"/out/*.json "$OUT"/ 2>/dev/null
  tar czf "$OUT/lease.tgz" -C /tmp --exclude='*.safetensors' --exclude='*.bin' --exclude='pt-*/**/model*' \
    lease/out lease/driver.log $(cd /tmp && ls -d lease/phase-*.log gpu-run-* 2>/dev/null) 2>/dev/null
  # the quick caches (pack_quick) where the call's 8 files and 64 MiB leave room for all of them
  parts=$(ls "$lease"/quick/cache-* 2>/dev/null | wc -l)
  if [ "$parts" -gt 0 ] && [ $(( $(ls "$OUT" | wc -l) + parts )) -le 8 ] &&
     [ $(( $(du -cb "$OUT"/* "$lease"/quick/cache-* | tail -n 1 | cut -f1) )) -le 60000000 ]; then
    mkdir -p "$OUT/quick-cache" && cp "$lease"/quick/cache-* "$OUT/quick-cache/" && echo "quick caches: $parts part(s) back"
  else
    echo "quick caches: $parts part(s), not back in this call (no room)"
  fi
  [ -e "$lease/done" ] && echo "lease job: done" || echo "lease job: running"
  cat "$lease/driver.log"
  for f in /tmp/gpu-run-*/rc.txt; do [ -e "$f" ] && { echo "== $f"; cat "$f"; }; done
  # kernels vLLM's JIT monitor saw compiled while requests were served (a spike a user's request pays)
  grep -ho "JIT compilation during inference: [A-Za-z0-9_]*" /tmp/gpu-run-*/logs/* 2>/dev/null | sort | uniq -c
  for f in /tmp/gpu-run-*/*.txt /tmp/gpu-run-*/logs/*; do
    [ -f "$f" ] && { echo "== $f"; tail -n 3 "$f" | cut -c1-300; }
  done
  # the test processes' pytest logs: the summary, or the progress line so far (lease 2026-12-07f read them by hand)
  for f in /tmp/gpu-run-*/*.log; do
    [ -s "$f" ] && echo "== $f: $(grep -E '^[0-9]+ (passed|failed|error)|^[.FEsx]+ *(\[ *[0-9]+%\])?$' "$f" | tail -n 1 | cut -c1-200)"
  done
  ;;
caches|quick)
  # bring back cache parts FROM .. FROM+COUNT-1 (15 MB each; a call returns 8 files and 64 MiB with the tree):
  # `caches` the full pack (after the job), `quick` the quick pack of the last finished phase (any time; what
  # `collect` had no room for), into $OUT/quick-cache/ as the next lease's .gpucache/quick-cache/ takes them
  : "${OUT:?OUT}"
  from=${1:-0} count=${2:-3}
  src=$lease dst=$OUT
  [ "$mode" = quick ] && src=$lease/quick dst=$OUT/quick-cache && mkdir -p "$dst"
  cat "$lease/out/caches.txt" 2>/dev/null
  for i in $(seq "$from" $((from + count - 1))); do
    f=$(printf '%s/cache-%02d' "$src" "$i"); [ -e "$f" ] && cp "$f" "$dst"/
  done
  ls -l "$dst"
  ;;
*) echo "unknown mode $mode" >&2; exit 2 ;;
esac
