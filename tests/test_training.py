"""Training runs through the real path: submitit LocalExecutor -> torch.distributed (gloo)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from conftest import assert_same_parameters, read_json, train_run
from dtstudy.runspec import METRICS_FILE


def test_allreduce_two_workers_equal_one_worker_with_double_batch(tmp_path, tiny_data):
    """STUDY.md: N workers x batch b == 1 worker x batch N*b, same LR, after the same steps."""
    metrics_2, params_2, _ = train_run(tmp_path, tiny_data, workers=2, batch_size=32)
    metrics_1, params_1, _ = train_run(tmp_path, tiny_data, workers=1, batch_size=64)
    assert metrics_2["steps"] == metrics_1["steps"] == 12
    assert_same_parameters(params_2, params_1, atol=1e-5)

    # the comparison has teeth: a different seed (other data order and init) lands elsewhere
    _, params_other, _ = train_run(tmp_path, tiny_data, workers=1, batch_size=64, seed=1)
    with pytest.raises(AssertionError):
        assert_same_parameters(params_other, params_1, atol=1e-5)


def test_metrics_record_what_the_study_needs(tmp_path, tiny_data):
    metrics, _, out = train_run(tmp_path, tiny_data, workers=2, batch_size=32, steps=None)
    assert read_json(out / METRICS_FILE) == metrics
    assert metrics["steps"] == 1800 // 64 and len(metrics["train_loss"]) == metrics["steps"]
    assert metrics["images"] == metrics["steps"] * 64
    assert metrics["throughput"] > 0 and len(metrics["throughput_per_worker"]) == 2
    step = metrics["step_time"]
    assert step["compute_s"] + step["comm_s"] == pytest.approx(step["total_s"])
    assert 0 < step["comm_s"] < step["total_s"]
    lenet_bytes = sum(p.numel() for p in _lenet().parameters()) * 4
    assert metrics["bytes_per_step"] == pytest.approx(lenet_bytes)  # ring: 2 (N-1)/N = 1 at N=2
    assert [v["epoch"] for v in metrics["val"]] == [1] and 0 <= metrics["val"][0]["top1"] <= 1
    assert metrics["environment"]["backend"] == "gloo" and metrics["environment"]["processes"] == 2
    assert metrics["lr_schedule"]["rule"] == "none"
    # reruns with the same seed give the same numbers
    again, _, _ = train_run(tmp_path / "again", tiny_data, workers=2, batch_size=32, steps=None)
    assert again["train_loss"] == metrics["train_loss"] and again["val"][0]["top1"] == metrics["val"][0]["top1"]


def _lenet():
    from dtstudy.models import build_model

    return build_model("lenet5", 1, 10, 28)


def test_failed_job_leaves_no_metrics_and_says_why(tmp_path, tiny_data):
    out = tmp_path / "run"
    out.mkdir()
    (out / METRICS_FILE).write_text("{}")  # stale result of an earlier run
    missing_data = tmp_path / "empty-data"
    missing_data.mkdir()
    result = subprocess.run(
        [sys.executable, "-m", "dtstudy", "train", "--config", "config/config.yaml", "--strategy", "allreduce",
         "--workers", "1", "--seed", "0", "--data", str(missing_data), "--out", str(out), "--no-tracking"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode != 0
    assert "empty-data" in result.stderr  # the job's error reaches the caller
    assert not (out / METRICS_FILE).exists()


def test_interrupting_the_launcher_cancels_the_job(tmp_path, tiny_data):
    """Snakemake stops a local rule with a signal: the submitit job must not outlive it."""
    import os
    import re
    import signal
    import time

    out = tmp_path / "run"
    config = tmp_path / "long.yaml"
    config.write_text("dataset: {subset: 2000}\ntrain: {epochs: 500, batch_size: 8, log_every: 10}\n")
    launcher = subprocess.Popen(
        [sys.executable, "-u", "-m", "dtstudy", "train", "--config", str(config), "--strategy", "allreduce",
         "--workers", "2", "--seed", "0", "--data", str(tiny_data), "--out", str(out), "--no-tracking"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        # as under a shell's `&`: SIGINT ignored, so only a real cancellation stops the job
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    seen, job_pid = "", None
    deadline = time.time() + 120
    while time.time() < deadline and "img/s" not in seen:
        seen += launcher.stdout.readline()
        match = re.search(r"submitted job (\d+)", seen)
        job_pid = job_pid or (match and int(match.group(1)))
    assert job_pid and "img/s" in seen, seen  # training is under way
    launcher.send_signal(signal.SIGTERM)
    launcher.wait(timeout=60)
    assert launcher.returncode != 0
    for _ in range(100):  # the local job's id is its process id
        try:
            os.kill(job_pid, 0)
        except ProcessLookupError:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"job process {job_pid} still runs after the launcher was stopped")
    # the run's processes (forked by the warm pool, not children of the job) are gone too
    ranks = read_json(out / "submitit" / f"{job_pid}_ranks.json")
    assert sorted(ranks) == ["0", "1"]
    for _ in range(100):
        alive = [pid for pid in ranks.values() if Path(f"/proc/{pid}").exists()
                 and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"]
        if not alive:
            break
        time.sleep(0.2)
    else:
        pytest.fail(f"rank processes {alive} still run after the launcher was stopped")
    assert not (out / METRICS_FILE).exists()
