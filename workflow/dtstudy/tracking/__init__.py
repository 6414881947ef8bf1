"""What a run leaves behind: its MLflow records (`mlflow_store`, `live_run`), its files
(`run_outputs`) and where its numbers came from (`provenance`)."""
