"""dtstudy: a reproducible study of distributed training strategies for a CNN.

Modules, one concern each:
  config      load, validate (JSON schema) and check a study config
  data        prepare a data set once, load its splits fast in every worker
  models      the CNNs (lenet5, resnet18, resnet50)
  schedule    learning-rate scaling rule and warm-up schedule
  strategies  one class per distributed strategy, found by name in a registry
  distributed the process-group set-up inside a submitit job
  train       the training loop (one worker) and the submitted job
  launcher    submit a training job with submitit and wait for it
  evaluate    test top-1/top-5 of a final checkpoint
  aggregate   scaling/accuracy tables, plots and the MLflow study run
  tracking    MLflow helpers
The command line is `python -m dtstudy --help`.
"""

__version__ = "0.1.0"
