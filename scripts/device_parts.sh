#!/usr/bin/env bash
# Here, before a GPU lease: the device bundle (../shared/tools/device-vllm.sh build: vLLM 0.32.0, torch
# 2.13.0 and their wheels as .gpuvllm/part-NN), torchvision 0.28.0 beside it (.gpuvllm/tv: vLLM's
# warm-ups import it; scripts/h200_session.sh installs it), and the parts re-cut so each fits one call
# beside the working tree: a call carries 64 MiB in all, tracked files included (9 MiB and growing with
# benchmarks/results), and the tool's 58 MB parts stopped fitting on 2026-12-06.
#
#   bash scripts/device_parts.sh        # prints the part count; the lease plan is in
#                                       # benchmarks/results/gpu_serving_h200.md
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
[ -e .gpuvllm/device-install.sh ] || ../shared/tools/device-vllm.sh build > /tmp/device-vllm-build.log
ls .gpuvllm/tv/torchvision-0.28.0-*.whl >/dev/null 2>&1 ||
  python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 torchvision==0.28.0 -d .gpuvllm/tv
# what a call carries besides one part: the tracked and untracked-not-ignored files, and 2 MiB to spare
tree=$(git ls-files -z --cached --others --exclude-standard | du -cb --files0-from=- 2>/dev/null | tail -n 1 | cut -f1)
part=$(( 64 * 1024 * 1024 - tree - 2 * 1024 * 1024 ))
[ "$part" -gt 8000000 ] || { echo "the working tree ($tree bytes) leaves no room for a part" >&2; exit 1; }
# re-cut when a part no longer fits, or is far smaller than fits (each part costs a call); an all.tar
# left by an interrupted re-cut is the whole bundle
first=$(ls .gpuvllm/part-* 2>/dev/null | head -n 1 || true)
size=$([ -n "$first" ] && stat -c %s "$first" || echo 0)
if [ -e .gpuvllm/all.tar ] || [ "$size" -gt "$part" ] || [ "$size" -lt $(( part - 4 * 1024 * 1024 )) ]; then
  [ -e .gpuvllm/all.tar ] || cat .gpuvllm/part-* > .gpuvllm/all.tar
  rm -f .gpuvllm/part-*
  [ $(( $(stat -c %s .gpuvllm/all.tar) / part )) -lt 100 ] ||
    { echo "the working tree ($tree bytes) leaves parts too small for 100 names: untrack what grew" >&2; exit 1; }
  split -b "$part" -d -a 2 .gpuvllm/all.tar .gpuvllm/part- && rm .gpuvllm/all.tar
fi
echo "$(ls .gpuvllm/part-* | wc -l) parts of at most $part bytes (tree $tree bytes); then device-install.sh with .gpuvllm/tv"
