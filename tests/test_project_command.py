"""`python -m dtstudy project`: one sub-command per thing it does (commbench: measure this
machine's collectives; study: the project rule's projection of a study; measured: a
measurement file on a hardware profile), each with its own required arguments, which argparse
names when one is missing (exit status 2); the commbench sub-command writes what the benchmark
measured; every `python -m dtstudy` command the rules run parses. The study and measured
sub-commands' runs on small cases are in tests/test_projection.py
(test_project_rule_adds_its_table_and_plot_to_the_mlflow_study_run, test_command_has_no_band)."""

from __future__ import annotations

import json
import shlex

import pytest
from conftest import run_snakemake, tiny_study

from dtstudy import __main__ as cli

#: each sub-command's required arguments, with a value each
REQUIRED = {
    "commbench": {"--out": "commbench.json"},
    "study": {
        "--metrics": "a/metrics.json",
        "--commbench": "commbench.json",
        "--out": "p.csv",
        "--out-md": "p.md",
        "--plot": "p.png",
    },
    "measured": {"--measured": "M.yaml", "--hardware": "H.yaml", "--strategies": "allreduce", "--workers": "1,8"},
}
MISSING = [(mode, flag) for mode, flags in REQUIRED.items() for flag in flags]


def arguments(mode: str, leave_out: str | None = None) -> list[str]:
    return [
        "project",
        mode,
        *(word for flag, value in REQUIRED[mode].items() if flag != leave_out for word in (flag, value)),
    ]


@pytest.mark.parametrize("mode, missing", MISSING, ids=[f"{mode}{flag}" for mode, flag in MISSING])
def test_a_missing_required_argument_is_argparses_error_naming_it(capsys, mode, missing):
    with pytest.raises(SystemExit) as exited:
        cli.main(arguments(mode, leave_out=missing))
    assert exited.value.code == 2
    assert (
        f"python -m dtstudy project {mode}: error: the following arguments are required: {missing}"
        in capsys.readouterr().err
    )
    # the control: with it, the same line parses into that sub-command
    parsed = cli.build_parser().parse_args(arguments(mode))
    assert parsed.func.__name__ == f"cmd_project_{mode}"


def test_a_missing_sub_command_is_named_by_its_choices(capsys):
    with pytest.raises(SystemExit) as exited:
        cli.main(["project"])
    assert exited.value.code == 2
    assert "the following arguments are required: {commbench,study,measured}" in capsys.readouterr().err


@pytest.mark.parametrize("given, priority", [("idle", "idle"), ("7", 7)])
def test_the_commbench_sub_command_writes_what_the_benchmark_measured(tmp_path, monkeypatch, given, priority):
    """The benchmark itself (a minute of two processes timing each other) is the commbench
    rule's, run by the end-to-end study; here its measurement is a stand-in, and the command
    must write it where --out says, measured with gloo's loops at --gloo-loop-nice."""
    from dtstudy.projection import commbench

    asked = {}

    def measure(sizes=None, repeats=commbench.REPEATS, gloo_loop_nice=0):
        asked["gloo_loop_nice"] = gloo_loop_nice
        return {"processes": 2, "gloo_loop_nice": gloo_loop_nice}

    monkeypatch.setattr(commbench, "measure", measure)
    out = tmp_path / "commbench" / "commbench.json"
    assert cli.main(["project", "commbench", "--out", str(out), "--gloo-loop-nice", given]) == 0
    assert asked == {"gloo_loop_nice": priority}
    assert json.loads(out.read_text()) == {"processes": 2, "gloo_loop_nice": priority}


def test_every_command_the_rules_run_parses(tmp_path):
    """A dry run of a tiny local study prints each job's command: every `python -m dtstudy`
    among them parses with the command line's parser (a rule left on an old form of a command
    would fail only when its job runs), the commbench and project rules into their sub-commands."""
    result = run_snakemake(tmp_path, tiny_study(), "--dry-run", "--printshellcmds", "--cores", "2", timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    prefix = "Shell command: python -m dtstudy "
    commands = [line.split(prefix, 1)[1] for line in result.stdout.splitlines() if prefix in line]
    parsed = [cli.build_parser().parse_args(shlex.split(command.split(" > ", 1)[0])) for command in commands]
    ran = {args.func.__name__ for args in parsed}
    assert {"cmd_project_commbench", "cmd_project_study", "cmd_train", "cmd_aggregate"} <= ran, ran
