"""A training run's folder and the name of every file in it: the one place those names are written.

    <run folder>/metrics.json          the run's measurements; the train rule's output, written last
                 model.pt              the final model (the evaluate rule tests it)
                 eval.json             the test pass's result (tested kinds only)
                 mlflow_run.json       the run's MLflow id, as soon as the run exists there
                 mlflow_pending.json   what the run could not deliver to MLflow before it ended
                 resume/rank<r>.pt     an interrupted run's saved state, one file per rank ...
                 resume/rank<r>.prev.pt  ... and the one before it, kept until every rank wrote the next
                 submitit/             the job's logs, unless the launcher is given another folder

The Snakemake rules take the bare names (METRICS, MODEL, EVALUATION) for their outputs;
everything else asks a RunFolder. Imports nothing of the study (the rules' parse, the launcher).
"""

from __future__ import annotations

from pathlib import Path

METRICS = "metrics.json"
MODEL = "model.pt"
EVALUATION = "eval.json"
MLFLOW_RUN = "mlflow_run.json"
MLFLOW_PENDING = "mlflow_pending.json"
RESUME = "resume"
JOB_LOGS = "submitit"

#: every name above: tests/test_run_folder.py holds the rest of the package to asking for them
NAMES = (METRICS, MODEL, EVALUATION, MLFLOW_RUN, MLFLOW_PENDING, RESUME, JOB_LOGS)


class RunFolder:
    """The files of one run's folder, by what they hold."""

    def __init__(self, path: str | Path):
        self.path = Path(path)

    def __repr__(self) -> str:
        return f"RunFolder({str(self.path)!r})"

    @property
    def metrics(self) -> Path:
        return self.path / METRICS

    @property
    def model(self) -> Path:
        return self.path / MODEL

    @property
    def evaluation(self) -> Path:
        return self.path / EVALUATION

    @property
    def mlflow_run(self) -> Path:
        return self.path / MLFLOW_RUN

    @property
    def mlflow_pending(self) -> Path:
        return self.path / MLFLOW_PENDING

    @property
    def resume(self) -> Path:
        """An interrupted run's saved state (dtstudy.training.checkpoint); removed once the run is done."""
        return self.path / RESUME

    @property
    def job_logs(self) -> Path:
        """submitit's folder for the run's job when the launcher is given none."""
        return self.path / JOB_LOGS

    def rank_file(self, rank: int) -> Path:
        """A rank's last saved state."""
        return self.resume / f"rank{rank}.pt"

    def previous_rank_file(self, rank: int) -> Path:
        """The rank's state before its last one: kept until every rank has written the next."""
        return self.resume / f"rank{rank}.prev.pt"
