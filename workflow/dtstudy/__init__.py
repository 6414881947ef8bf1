"""dtstudy: a reproducible study of distributed training strategies for a CNN.

One folder per concern; the layering reads one way (a folder imports only those above it):

  errors, atomic_files   the config error every layer raises; whole-or-nothing writes
  gloo_loops             gloo's event-loop threads, lowered in priority (strategies, launch, benchmark)
  config/                the study config, torch-free: its JSON schema and messages, reading and slicing
  perfmodel/             the performance model's vocabulary: machines, collectives, waits, step formulas
  strategies/            one folder per family: each strategy's spec (knobs, checks, performance
                         model; torch-free) beside its class; the specs by name, the registry,
                         the interfaces (spec, base) and the device's clock (timing)
  runspec                one run (strategy x N x seed): its folder (common/run_folder), processes and tasks over nodes
  data/                  data-set checks, formats, one-off preparation, fast loading
  tracking/              MLflow records, a run's files, provenance
  analysis/              tables with confidence intervals, findings, plots, the study's MLflow run
  training/              one worker's loop, the CNNs, LR schedule, stragglers, measurements,
                         checkpoint and resume, the test pass
  launch/                submitit jobs, the warm pool, a task's process body and process group, cores
  projection/            hardware profiles, calibration, the communication benchmark, the projection
  checks                 the study config's checks across every layer (run when the Snakefile is parsed)

The command line is `python -m dtstudy --help`; docs/ describes the study by topic.
"""

__version__ = "0.1.0"
