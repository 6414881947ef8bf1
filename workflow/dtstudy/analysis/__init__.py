"""From finished runs to the study's tables, findings, plots and MLflow study run, with the
confidence intervals of every number."""
