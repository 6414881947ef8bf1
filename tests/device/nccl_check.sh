#!/usr/bin/env bash
# The NCCL path on one GPU machine (the device tool's H200; see tests/device/README.md).
# Every step runs even when one before it failed; what each printed is in $OUT.
#   1. the study (snakemake) on the GPU: every strategy at N=1 over NCCL, evaluate,
#      aggregate, project (tests/device/gpu-study.yaml)
#   2. allreduce, ps_sync and PowerSGD at N=1 as fresh submitit tasks (launcher.local_processes:
#      tasks; the study's config), then each compared with the study's run (train.deterministic)
#   3. N=2 on one GPU: must fail at once, naming the key (NCCL needs one GPU per worker)
# At N=1 no strategy exchanges anything between ranks; compute_check.sh runs every strategy's
# exchange at N=2 on the one GPU (over gloo), a node of several GPUs runs N>1 here (workers: [...]).
set -u
OUT=${OUT:-/tmp/nccl_check_out}; LOGS=/tmp/nccl_check_logs; mkdir -p "$OUT" "$LOGS"
export PYTHONUNBUFFERED=1
source tests/device/carried_packages.sh
use_carried_packages "$LOGS" || exit 1
CONFIG=${CONFIG:-tests/device/gpu-study.yaml}
step() {  # step NAME TIMEOUT_S COMMAND...: run, time, keep its output, go on
    local name=$1 limit=$2; shift 2
    local start=$SECONDS
    timeout "$limit" "$@" > "$LOGS/$name.log" 2>&1
    local rc=$?
    echo "== $name: rc $rc in $((SECONDS - start)) s"; tail -n 15 "$LOGS/$name.log"
}
{ nvidia-smi -L; python3 -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda,
  'gpus', torch.cuda.device_count(), 'nccl', torch.cuda.nccl.version() if torch.cuda.is_available() else None)"; } 2>&1

step study 300 snakemake --cores 8 --scheduler greedy --keep-going --configfile "$CONFIG"
python3 - <<'PY' 2>&1 | tee "$OUT/runs.txt"
import glob, json, os
for path in sorted(glob.glob("results/runs/*/n*/seed*/metrics.json")):
    m = json.load(open(path))
    evaluation = path.replace("metrics.json", "eval.json")
    top1 = json.load(open(evaluation))["top1"] if os.path.exists(evaluation) else None
    env = m["environment"]
    print(f"{m['strategy']:20s} N={m['workers']} {env['backend']:5s} {env['devices']} throughput {m['throughput_median']:8.0f} "
          f"img/s step {m['step_time']['total_s'] * 1e3:.2f} ms (comm {m['step_time']['comm_s'] * 1e3:.2f}) "
          f"val {m['final_val_top1']:.4f} test {top1}")
PY

# the study's config (config/config.yaml with $CONFIG over it, as snakemake merges them), with
# one submitit task per process: the same numbers as the study's runs are expected
mkdir -p /tmp/tasks && python3 - "$CONFIG" <<'PY'
import sys, yaml
from dtstudy.config.study_config import deep_merge
merged = deep_merge(yaml.safe_load(open("config/config.yaml")), yaml.safe_load(open(sys.argv[1])))
merged["launcher"]["local_processes"] = "tasks"
yaml.safe_dump(merged, open("/tmp/tasks/config.yaml", "w"))
PY
for strategy in allreduce ps_sync allreduce_powersgd; do
    step "tasks_$strategy" 120 python3 -m dtstudy train --config /tmp/tasks/config.yaml --strategy $strategy --workers 1 \
        --seed 0 --data results/data/fashion_mnist --out /tmp/tasks/$strategy --no-tracking
done
# train.deterministic (default true): the fresh tasks repeat the study's runs of the same
# strategy, seed and config, so they must end at the same numbers to the last digit
python3 - <<'PY' 2>&1 | tee "$OUT/repeat.txt"
import json, os
for strategy in ("allreduce", "ps_sync", "allreduce_powersgd"):
    paths = (f"results/runs/{strategy}/n1/seed0/metrics.json", f"/tmp/tasks/{strategy}/metrics.json")
    if not all(os.path.exists(path) for path in paths):
        print(f"repeat {strategy}: a run is missing"); continue
    study, task = (json.load(open(path)) for path in paths)
    same = study["train_loss"] == task["train_loss"] and study["final_val_top1"] == task["final_val_top1"]
    print(f"repeat {strategy}: val top-1 {study['final_val_top1']} / {task['final_val_top1']}, "
          f"{'the same' if same else 'DIFFERENT'} losses; kernels {task['environment'].get('kernels')}")
PY
sed 's/workers: \[1\]/workers: [2]/' "$CONFIG" > /tmp/tasks/n2.yaml
step n2_on_one_gpu 120 python3 -m dtstudy train --config /tmp/tasks/n2.yaml --strategy allreduce --workers 2 --seed 0 \
    --data results/data/fashion_mnist --out /tmp/tasks/n2 --no-tracking
grep -h -o "launcher.device.*gloo)" /tmp/tasks/n2/submitit/*.err 2>/dev/null | head -2
# (the device tool brings back at most 8 files: everything else travels in one archive)
tar czf "$OUT/results.tgz" "$LOGS" results/tables results/logs results/runs/*/n*/seed*/*.json /tmp/tasks/*/submitit \
    .snakemake/log 2>/dev/null
ls -la "$OUT"
