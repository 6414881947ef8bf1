"""The study on a two-node SLURM on one machine (tests/slurm/two_nodes/up.sh): each node a
network namespace with its own host name and address on a private bridge, slurmctld, the
accounting and the login side (Snakemake, the MLflow server) in the root namespace. What only
several nodes exercise: the rendezvous across hosts, the runs' ranks on two hosts, a node lost,
the tracking server reached from the nodes by name."""

from __future__ import annotations

import os
import re
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.slurm

TWO_NODES = REPO / "tests" / "slurm" / "two_nodes"
CLUSTER_BASE = Path(os.environ.get("BASE", "/tmp/dtstudy-slurm2"))  # up.sh's configs, state and logs


def cluster_names() -> dict[str, str]:
    """tests/slurm/two_nodes/cluster.env: the nodes' and the login side's names and addresses."""
    names = {}
    for line in (TWO_NODES / "cluster.env").read_text().splitlines():
        if "=" in line and not line.startswith("#"):
            key, value = line.split("=", 1)
            names[key] = value.strip('"')
    return names


CLUSTER = cluster_names()
NODES = [CLUSTER["NODE1"], CLUSTER["NODE2"]]


def namespaces_refused() -> str | None:
    """Why this machine cannot make the cluster's network namespaces; None when it can."""
    if os.geteuid() != 0:
        return "the two-node SLURM makes network namespaces and starts its daemons as root"
    probe = subprocess.run(["ip", "netns", "add", "dtstudy-probe"], capture_output=True, text=True)
    if probe.returncode != 0:
        return f"no network namespaces here: `ip netns add` said {probe.stderr.strip()!r}"
    subprocess.run(["ip", "netns", "del", "dtstudy-probe"], capture_output=True)
    return None


@pytest.fixture(scope="module")
def two_nodes():
    """The two-node SLURM of tests/slurm/two_nodes (kept running if it was already up); it
    cannot run beside the one-node cluster of tests/test_slurm.py, whose module fixture stops
    it when that module ends."""
    refused = namespaces_refused()
    if refused:
        pytest.skip(refused)
    up = subprocess.run(["bash", str(TWO_NODES / "up.sh")], capture_output=True, text=True)
    assert up.returncode == 0, up.stdout + up.stderr
    yield CLUSTER
    if "already runs" not in up.stdout:
        down = subprocess.run(["bash", str(TWO_NODES / "down.sh")], capture_output=True, text=True)
        assert down.returncode == 0, down.stdout + down.stderr


def test_a_job_of_two_nodes_runs_on_two_hosts_that_reach_each_other(two_nodes):
    """srun over both nodes: one task on each, each with its node's host name and address, and
    each reaching the other node and the login side by name (a TCP connection to the other's
    slurmd port and to slurmctld's)."""
    probe = (
        "import socket; me = socket.gethostname(); "
        f"peer = {{'{NODES[0]}': '{NODES[1]}', '{NODES[1]}': '{NODES[0]}'}}[me]; "
        f"socket.create_connection((peer, 16828), timeout=5).close(); "
        f"socket.create_connection(('{two_nodes['LOGIN']}', 16827), timeout=5).close(); "
        "print(me, socket.gethostbyname(me), peer)"
    )
    tasks = subprocess.run(
        ["srun", "-N2", "--ntasks-per-node=1", "python3", "-c", probe], capture_output=True, text=True, timeout=120
    )
    assert tasks.returncode == 0, tasks.stdout + tasks.stderr
    seen = sorted(tuple(line.split()) for line in tasks.stdout.splitlines())
    assert seen == [(NODES[0], two_nodes["NODE1_ADDR"], NODES[1]), (NODES[1], two_nodes["NODE2_ADDR"], NODES[0])]


STUDY_USER = "dtstudy"


@pytest.fixture(scope="module")
def login_mlflow(two_nodes, tmp_path_factory):
    """A real `mlflow server` on the login side with MLflow's basic-auth app, listening on the
    bridge's address and reached from the nodes by the login side's name, as docs/cluster.md
    says to run it. Its one account is the study's (the admin the app creates on its first
    start, with a password drawn here, `server.password`: not in the fixture's value, which a
    failing test prints); anyone else has no permission."""
    import secrets

    from conftest import MlflowServer

    folder = tmp_path_factory.mktemp("mlflow-login")
    (folder / "auth.ini").write_text(AUTH_INI.format(folder=folder, user=STUDY_USER))
    password = secrets.token_urlsafe(18)
    login = two_nodes["LOGIN"]
    server = MlflowServer(
        folder,
        host=two_nodes["LOGIN_ADDR"],
        name=login,
        # MLflow 3 answers only the Host headers it allows (against DNS rebinding): localhost
        # and addresses by default, not the login node's name
        options=("--app-name", "basic-auth", "--allowed-hosts", f"{login},{login}:*"),
        env={
            "MLFLOW_AUTH_CONFIG_PATH": str(folder / "auth.ini"),
            "MLFLOW_AUTH_ADMIN_PASSWORD": password,
            "MLFLOW_FLASK_SERVER_SECRET_KEY": secrets.token_hex(16),
        },
    ).start()
    server.password = password
    yield server
    server.stop()


# docs/cluster.md's auth.ini, the store in the test's folder
AUTH_INI = """[mlflow]
default_permission = NO_PERMISSIONS
database_uri = sqlite:///{folder}/auth.db
admin_username = {user}
authorization_function = mlflow.server.auth:authenticate_request_basic_auth
grant_default_workspace_access = false
"""
STUDY_STRATEGIES = ["allreduce", "ps_sync", "gossip", "local_sgd"]


def test_tiny_study_at_n4_spans_both_nodes_and_logs_to_an_authenticated_server(
    tmp_path, two_nodes, login_mlflow, monkeypatch
):
    """The tiny SLURM study at N = 4 with 2 (fake) GPUs per node through `snakemake --profile
    slurm`: each run's job spans both nodes (the rendezvous at the first node's name, gloo
    between the namespaces, ps_sync's shards tasks on the nodes), its metrics.json names two
    workers on each host, and the tables and MLflow runs come out as on one node. The tracking
    server asks for a password, which the study has from its environment alone; it is restarted
    while the runs train and loses no metric; a client without the password is refused; the
    password is in no file the study wrote."""
    import mlflow
    from conftest import read_json
    from test_slurm import restart_while_training, run_names, sacct_states, slurm_snakemake, tiny_cluster_study

    server, password = login_mlflow, login_mlflow.password
    # rank 0 logs the loss of every 5th step: 14 steps an epoch at N = 4
    study = tiny_cluster_study(
        strategies=STUDY_STRATEGIES,
        workers=[4],
        launcher={"gpus_per_node": 2},
        train={"log_every": 5},
        tracking={"uri": server.uri, "experiment": "two-nodes"},
    )
    names = run_names(study)
    runs = [tmp_path / f"results/runs/{strategy}/n4/seed0" for strategy in STUDY_STRATEGIES]
    since = time.strftime("%Y-%m-%dT%H:%M:%S")
    credentials = {"MLFLOW_TRACKING_USERNAME": STUDY_USER, "MLFLOW_TRACKING_PASSWORD": password}
    process = slurm_snakemake(tmp_path, study, env={**os.environ, **credentials})
    met_training = restart_while_training(server, process, runs, tmp_path / "results/logs", time.monotonic() + 600)
    output = process.communicate(timeout=900)[0]
    assert process.returncode == 0, output[-6000:]
    assert met_training  # the outage met a run that was still training

    assert sacct_states(names, since) == {name: ["COMPLETED"] for name in names}
    nodes = subprocess.run(
        ["sacct", "-n", "-P", "-X", "-S", since, "-o", "JobName,NodeList", "--name", ",".join(names)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert sorted(nodes) == sorted(f"{name}|dtnode[1-2]" for name in names), nodes
    for strategy, run in zip(STUDY_STRATEGIES, runs):
        metrics = read_json(run / "metrics.json")
        # workers first on each node (dtstudy.runspec.TaskLayout): ranks 0 and 1 on the first
        assert metrics["environment"]["worker_hosts"] == [NODES[0], NODES[0], NODES[1], NODES[1]], strategy
        assert metrics["environment"]["processes"] == 4 + metrics["strategy_params"].get("shards", 0)
        assert metrics["steps"] > 0 and metrics["images"] == metrics["steps"] * 32 * 4
        assert 0 < read_json(run / "eval.json")["top1"] <= 1
    scaling = (tmp_path / "results/tables/scaling.csv").read_text().splitlines()
    assert len(scaling) == 1 + len(names)

    with pytest.raises(mlflow.exceptions.MlflowException, match="401"):
        mlflow.MlflowClient(server.uri).search_experiments()
    for name, value in credentials.items():
        monkeypatch.setenv(name, value)
    client = mlflow.MlflowClient(server.uri)
    mlflow.set_tracking_uri(server.uri)
    logged = mlflow.search_runs(experiment_names=["two-nodes"])
    trained = logged[logged["tags.dtstudy.kind"] == "training"]
    assert len(trained) == len(names) and (trained["status"] == "FINISHED").all()
    assert trained["metrics.test_top1"].notna().all()
    every = study["train"]["log_every"]
    for run in runs:  # every point measured reached MLflow, those of the outage too
        metrics, run_id = read_json(run / "metrics.json"), read_json(run / "mlflow_run.json")["run_id"]
        steps = [m.step for m in client.get_metric_history(run_id, "train_loss")]
        assert sorted(steps) == [step for step in range(metrics["steps"]) if (step + 1) % every == 0] != []
        assert len(client.get_metric_history(run_id, "train_loss_mean")) == metrics["steps"]
    assert not any(password in str(value) for value in logged.to_dict("list").values())  # params, tags
    # what the study wrote, what the server logged, what the cluster's daemons logged
    searched = [*tmp_path.rglob("*"), server.folder / "server.log", *CLUSTER_BASE.glob("log/*")]
    written = [path for path in searched if path.is_file() and password.encode() in path.read_bytes()]
    assert written == []


JOIN = """
import os
from dtstudy.launch.process_group import join_process_group
from dtstudy.runspec import TaskLayout
join_process_group(TaskLayout(2, 0, 2), int(os.environ["SLURM_PROCID"]), 0, "cpu", timeout_min=10, comm_timeout_s=10)
print("joined", flush=True)
"""


def test_a_rank_whose_node_cannot_reach_master_addr_fails_naming_host_and_address(two_nodes):
    """MASTER_ADDR an address of the first node on a network the second has no route to (a
    host name resolving to the wrong interface): the second node's rank fails within
    launcher.comm_timeout_s (10 s here), naming its host and the address, where torch's store
    would wait out the rendezvous (10 min here); srun --kill-on-bad-exit ends the job."""
    from dtstudy.common.ports import free_port

    unroutable = "10.78.0.11"  # on the first node only; the second routes only the bridge's subnet
    node1 = ["ip", "netns", "exec", NODES[0], "ip", "addr"]
    subprocess.run([*node1, "add", f"{unroutable}/24", "dev", "eth0"], check=True)
    try:
        started = time.monotonic()
        job = subprocess.run(
            ["srun", "-N2", "--ntasks-per-node=1", "--kill-on-bad-exit=1", "python3", "-c", JOIN],
            capture_output=True,
            text=True,
            timeout=180,
            env={**os.environ, "MASTER_ADDR": unroutable, "MASTER_PORT": str(free_port())},
        )
        took = time.monotonic() - started
    finally:
        subprocess.run([*node1, "del", f"{unroutable}/24", "dev", "eth0"], check=True)
    assert job.returncode != 0 and "joined" not in job.stdout, job.stdout + job.stderr
    assert f"rank 1 on {NODES[1]} cannot reach MASTER_ADDR {unroutable} port" in job.stderr, job.stderr
    assert took < 90, took  # 10 s, the imports and srun on a busy machine


def test_a_lost_node_fails_its_job_and_the_run_resumes_as_if_uninterrupted(tmp_path, tiny_data, two_nodes):
    """An N = 2 run with one GPU a node, so one worker on each node. Once it has checkpointed,
    the second node is lost whole (its slurmd and every process on it killed at once): the
    job fails within launcher.comm_timeout_s, naming the rank (a peer on another host is lost
    once its heartbeats are missed for half of it); the node comes back (a reboot) and the launcher's
    resubmitted job resumes from the checkpoints and ends with an uninterrupted run's metrics."""
    from test_faults import CHECKPOINTED, launch, start
    from test_pool import wait_for_output
    from test_slurm import assert_ends_as_uninterrupted

    from dtstudy.runspec import lost_rank_path

    comm_timeout_s = 20
    slurm = {
        "cluster": "slurm",
        "device": "cpu",
        "gpus_per_node": 1,
        "cpus_per_task": 1,
        "partition": None,
        "timeout_min": 10,
        "signal_delay_s": 60,
        "comm_timeout_s": comm_timeout_s,
        "max_resubmits": 1,
    }
    slow = {"ranks": [1], "delay_ms": 100, "distribution": "uniform", "seed": 3}  # ~12 s of training
    command, out, _ = launch(tmp_path, tiny_data, "allreduce", train=CHECKPOINTED, launcher=slurm, stragglers=slow)
    launcher = start(command)
    seen = wait_for_output(launcher, r"submitted job (\d+)", timeout_s=120)
    job_id = re.search(r"submitted job (\d+)", seen).group(1)
    seen += wait_for_output(launcher, r"checkpoint at step (1\d|[2-9]\d)\b", timeout_s=300)
    lost_at = time.monotonic()
    node = ["bash", str(TWO_NODES / "node.sh")]
    subprocess.run([*node, "kill", NODES[1]], check=True)
    record = lost_rank_path(tmp_path / "run-job", job_id)
    while not record.exists() and launcher.poll() is None and time.monotonic() - lost_at < 120:
        time.sleep(0.2)
    took = time.monotonic() - lost_at
    if not record.exists():  # the launcher would wait for SLURM to find the node down, then for the node
        launcher.terminate()
        pytest.fail(
            f"no rank recorded lost {took:.0f} s after node {NODES[1]} was: {launcher.communicate(timeout=120)}"
        )
    subprocess.run([*node, "start", NODES[1]], check=True)  # the node rebooted
    seen += wait_for_output(launcher, r"resubmitting it", timeout_s=180)
    stdout, stderr = launcher.communicate(timeout=400)
    seen += stdout
    print(f"node {NODES[1]} lost: recorded {took:.1f} s later")
    assert launcher.returncode == 0, seen[-3000:] + stderr[-3000:]
    assert took < comm_timeout_s, took
    assert re.search(rf"job {job_id} failed: rank 1 was lost \(no heartbeat", seen), seen[-3000:]
    resumed = re.search(r"^resumed from step (\d+) ", seen, re.M)
    assert resumed and int(resumed.group(1)) > 0, seen[-3000:]

    metrics = assert_ends_as_uninterrupted(tmp_path, tiny_data, "allreduce", out, slow)
    assert metrics["environment"]["worker_hosts"] == NODES
