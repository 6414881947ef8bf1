#!/usr/bin/env bash
# The compute check on one GPU (see tests/device/README.md): ResNet-50 in bf16 from a generated
# JPEG tree through the study's own path (one fresh, unpinned submitit task) against a
# torchvision-reference-style loop with the study's decoder, in the same run, then every cluster
# strategy at N=2 on the GPU over gloo; writes $OUT/compute_check.json step by step (the record
# docs/testing.md quotes once kept).
#   bash tests/device/compute_check.sh              # on the GPU machine, from the repository root
#   bash tests/device/compute_check.sh --dry-run    # anywhere: the same steps on the CPU, tiny
set -u
OUT=${OUT:-/tmp/compute_check_out}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1
source tests/device/carried_packages.sh
use_carried_packages "$OUT" || exit 1
if [ "${1:-}" != "--dry-run" ]; then
    nvidia-smi -L 2>&1
fi
# on the GPU, 540 s in all (the device machine lends 15 minutes, its start included); the check
# writes compute_check.json after every step, so a time-out keeps what it measured
limit=540; [ "${1:-}" = "--dry-run" ] && limit=1800
start=$SECONDS
timeout "$limit" python3 tests/device/compute_check.py --out "$OUT" "$@" > "$OUT/compute_check.log" 2>&1
rc=$?
echo "== compute check: rc $rc in $((SECONDS - start)) s"; tail -n 40 "$OUT/compute_check.log"
exit $rc
