#!/usr/bin/env bash
# The compute check on one GPU (see tests/device/README.md): ResNet-50 in bf16 from a generated
# JPEG tree through the study's own path against a torchvision-reference-style loop, in the
# same run; writes $OUT/compute_check.json (the record docs/testing.md quotes once kept).
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
start=$SECONDS
timeout 540 python3 tests/device/compute_check.py --out "$OUT" "$@" > "$OUT/compute_check.log" 2>&1
rc=$?
echo "== compute check: rc $rc in $((SECONDS - start)) s"; tail -n 40 "$OUT/compute_check.log"
exit $rc
