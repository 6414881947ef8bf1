"""A run's folder (dtstudy.common.run_folder): the one module that names its files. The rest of
workflow/ asks it instead of typing a name, and what training, checkpointing and tracking write
is what it names."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
from conftest import REPO, read_json, train_run

from dtstudy.common import run_folder
from dtstudy.common.run_folder import RunFolder

WORKFLOW = REPO / "workflow"
OWNER = WORKFLOW / "dtstudy" / "common" / "run_folder.py"
FILE_NAMES = [name for name in run_folder.NAMES if "." in name]
FOLDER_NAMES = [name for name in run_folder.NAMES if "." not in name]
# a path that ends in a run file's name: "metrics.json", f"{RUN_DIR}/model.pt", f"rank{rank}.pt"
# ("{}" stands for an f-string's fields); prose that mentions a file is not a path
RUN_FILE_PATH = re.compile(
    r"^(?:.*/)?(?:" + "|".join(map(re.escape, FILE_NAMES)) + r"|rank(?:\{\}|\d+)(?:\.prev)?\.pt)$"
)


def _docstrings(tree: ast.AST) -> set[int]:
    return {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }


def _template(node: ast.AST) -> str | None:
    """A string literal's text; an f-string's with "{}" for each field."""
    if isinstance(node, ast.JoinedStr):
        return "".join(part.value if isinstance(part, ast.Constant) else "{}" for part in node.values)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    return None


def retyped_in_python(source: str) -> list[tuple[int, str]]:
    """(line, literal) of each string literal of `source` that names a run's file or folder: a
    path ending in a file's name, or a folder's name joined onto a path (`out / "resume"`)."""
    tree = ast.parse(source)
    docstrings, found = _docstrings(tree), []
    for node in ast.walk(tree):
        text = _template(node)
        if text is not None and id(node) not in docstrings and RUN_FILE_PATH.match(text):
            found.append((node.lineno, text))
        if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Div) and _template(node.right) in FOLDER_NAMES:
            found.append((node.lineno, _template(node.right)))
    return found


def retyped_in_rules(source: str) -> list[tuple[int, str]]:
    """The same for a Snakefile or rule file (not Python): its quoted strings outside comments."""
    found = []
    for number, line in enumerate(source.splitlines(), 1):
        code = "" if line.lstrip().startswith("#") else line
        for double, single in re.findall(r'"([^"\n]*)"|\'([^\'\n]*)\'', code):
            if RUN_FILE_PATH.match(double or single):
                found.append((number, double or single))
    return found


def retyped_names(root: Path) -> list[str]:
    files = [*root.rglob("*.py"), *root.rglob("*.smk"), *root.parent.glob("Snakefile")]
    found = []
    for path in sorted(files):
        if path == OWNER or "__pycache__" in path.parts:
            continue
        check = retyped_in_python if path.suffix == ".py" else retyped_in_rules
        found += [f"{path.relative_to(root.parent)}:{line}: {text!r}" for line, text in check(path.read_text())]
    return found


# ----- structure: the names are written once --------------------------------------------------


def test_no_module_but_run_folder_types_a_run_files_name():
    found = retyped_names(WORKFLOW)
    assert not found, "ask dtstudy.common.run_folder instead of typing a run file's name:\n" + "\n".join(found)


@pytest.mark.parametrize(
    "planted, check",
    [
        ('path = Path(out) / "metrics.json"\n', retyped_in_python),
        ('path = out.with_name("model.pt")\n', retyped_in_python),
        ('path = f"{folder}/eval.json"\n', retyped_in_python),
        ('path = folder / f"rank{rank}.prev.pt"\n', retyped_in_python),
        ('path = Path(out) / "resume"\n', retyped_in_python),
        ('job_dir = out / "submitit"\n', retyped_in_python),
        ('        metrics=f"{RUN_DIR}/metrics.json",\n', retyped_in_rules),
        ('        evals=all_runs("eval.json", tested_only=True),\n', retyped_in_rules),
    ],
)
def test_the_check_finds_a_planted_name(planted, check):
    assert check(planted), planted


def test_the_check_leaves_prose_docstrings_and_comments_alone():
    source = (
        '"""Reads metrics.json."""\nx = "the 2-d weights of a run\'s model.pt"  # model.pt\nimport_name = "submitit"\n'
    )
    assert retyped_in_python(source) == []
    assert retyped_in_rules("# eval.json of the tested ones\nmetrics=all_runs(METRICS),\n") == []


def test_the_check_reads_the_whole_tree(tmp_path):
    """A name planted in the Snakefile, a rule file and a module of a copy of the tree is reported."""
    (tmp_path / "workflow" / "rules").mkdir(parents=True)
    (tmp_path / "workflow" / "dtstudy").mkdir()
    (tmp_path / "Snakefile").write_text('rule all:\n    input: "results/runs/a/n1/seed0/eval.json"\n')
    (tmp_path / "workflow" / "rules" / "train.smk").write_text('    output:\n        f"{RUN_DIR}/model.pt",\n')
    (tmp_path / "workflow" / "dtstudy" / "m.py").write_text('"""m."""\nNAME = "mlflow_run.json"\n')
    assert retyped_names(tmp_path / "workflow") == [
        "Snakefile:2: 'results/runs/a/n1/seed0/eval.json'",
        "workflow/dtstudy/m.py:2: 'mlflow_run.json'",
        "workflow/rules/train.smk:2: '{RUN_DIR}/model.pt'",
    ]


# ----- behaviour: what the module names is what the study writes --------------------------------


def test_a_hand_made_run_folders_paths(tmp_path):
    folder = RunFolder(str(tmp_path / "runs" / "allreduce" / "n2" / "seed0"))
    base = tmp_path / "runs" / "allreduce" / "n2" / "seed0"
    # the names on disk: renaming one orphans every finished study's results and resume state
    assert (folder.path, folder.metrics, folder.model, folder.evaluation) == (
        base,
        base / "metrics.json",
        base / "model.pt",
        base / "eval.json",
    )
    assert (folder.mlflow_run, folder.mlflow_pending, folder.job_logs) == (
        base / "mlflow_run.json",
        base / "mlflow_pending.json",
        base / "submitit",
    )
    assert (folder.resume, folder.rank_file(3), folder.previous_rank_file(3)) == (
        base / "resume",
        base / "resume" / "rank3.pt",
        base / "resume" / "rank3.prev.pt",
    )


def test_the_readme_names_the_files_a_run_folder_holds():
    readme = (REPO / "README.md").read_text()
    row = next(line for line in readme.splitlines() if line.startswith("| `results/runs/<strategy>/"))
    assert all(f"`{name}`" in row for name in (run_folder.METRICS, run_folder.MODEL, run_folder.EVALUATION)), row


def test_the_checkpoint_code_writes_and_reads_the_rank_files_the_folder_names(tmp_path):
    import torch

    from dtstudy.training import checkpoint

    folder = RunFolder(tmp_path / "run")
    identity = {"run_name": "allreduce-n2-seed0", "workers": 2}
    for rank in (0, 1):
        checkpoint.save_rank(folder, rank, identity, 10, {"x": torch.zeros(2)})
    checkpoint.save_rank(folder, 0, identity, 20, {"x": torch.ones(2)})
    assert sorted(folder.resume.iterdir()) == sorted(
        [folder.rank_file(0), folder.previous_rank_file(0), folder.rank_file(1)]
    )
    state, step, why = checkpoint.read_rank(folder, 0, identity)
    assert (step, why) == (20, "") and torch.equal(state["x"], torch.ones(2))
    assert checkpoint.read_rank(folder, 1, {**identity, "workers": 3})[2] == "incomplete set, rank2.pt missing"
    checkpoint.clear(folder)
    assert not folder.resume.exists() and folder.path.exists()


def test_the_tracking_code_reads_the_files_the_folder_names(tmp_path):
    from dtstudy.tracking.live_run import deliver_pending, recorded_run

    folder = RunFolder(tmp_path)
    assert recorded_run(folder.path) is None and deliver_pending(folder.path) is None  # nothing kept
    folder.mlflow_run.write_text(json.dumps({"run_id": "abc"}))
    assert recorded_run(folder.path) == {"run_id": "abc"}


@pytest.mark.slow
def test_a_finished_run_leaves_the_files_its_folder_names_and_evaluation_reads_them(tmp_path, tiny_data):
    from dtstudy.training.evaluate import evaluate_run

    metrics, _, out = train_run(tmp_path, tiny_data, workers=1, batch_size=32)
    folder = RunFolder(out)
    # the resume folder is gone (the run is complete); no MLflow files (no tracking)
    assert sorted(out.iterdir()) == sorted([folder.metrics, folder.model, folder.job_logs])
    assert read_json(folder.metrics) == metrics
    result = evaluate_run(folder.path, tiny_data, folder.evaluation)
    assert read_json(folder.evaluation) == result and result["checkpoint"] == str(folder.model)
