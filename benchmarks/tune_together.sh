#!/bin/bash
# Several `tvmflash tune` runs at once on one GPU machine, as BENCHMARKS.md's tuner runs were made:
# each run on its own CPU cores (taskset) and cache dir (its records apart from the others'), and all
# of them timing on the GPU one at a time (each cache dir's timing lock is a link to one file).
#
#   LIMIT=470 OUT=tune-logs bash benchmarks/tune_together.sh \
#     "causal-warm|0-7|--head-dim 128 --causal --trials 64" \
#     "causal-cold|8-15|--head-dim 128 --causal --trials 64 --cold"
#
# Each spec is "name|cores|tvmflash tune's arguments". Writes $OUT/name.txt (the run's output) and
# $OUT/records-name/ (its records, by `tvmflash cache export`), then $OUT.tgz of it all. LIMIT: the
# seconds each run may take (timeout). Two runs of 64 trials at 8 cores each took 400-412 s on the
# H200 (16 cores); four at 4 cores each did not finish in 530 s.
set -u
export PYTHONUNBUFFERED=1
LIMIT=${LIMIT:-600}
OUT=${OUT:-tune-logs}
mkdir -p "$OUT"
start=$(date +%s)
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/gpu.txt" 2>&1
one() {
  local name=$1 cores=$2 args=$3 cache=/tmp/tvmflash-tune-$1 visible=${CUDA_VISIBLE_DEVICES:-all}
  mkdir -p "$cache"
  ln -sf /tmp/tvmflash-gpu-timing.lock "$cache/gpu-timing-${visible//,/-}.lock"  # tune.runner.gpu_timing_lock's file
  echo "== tvmflash tune $args (cores $cores, limit $LIMIT s)" > "$OUT/$name.txt"
  # shellcheck disable=SC2086 # the arguments are words
  TVMFLASH_CACHE_DIR=$cache timeout "$LIMIT" taskset -c "$cores" python3 -m tvmflash.cli tune $args \
    --work-dir "/tmp/tvmflash-tune-work-$name" >> "$OUT/$name.txt" 2>&1
  local rc=$?
  echo "[$(( $(date +%s) - start )) s] tune $name rc=$rc" >> "$OUT/$name.txt"
  TVMFLASH_CACHE_DIR=$cache python3 -m tvmflash.cli cache export --out "$OUT/records-$name" >> "$OUT/$name.txt" 2>&1
}
for spec in "$@"; do
  IFS='|' read -r name cores args <<< "$spec"
  one "$name" "$cores" "$args" &
done
wait
echo "all done in $(( $(date +%s) - start )) s"
for f in "$OUT"/*.txt; do echo "== $f"; grep -aE "^(d[0-9]+ |tvmflash.compile at|stored|\[.*rc=)" "$f"; done
tar -czf "$OUT.tgz" "$OUT"
