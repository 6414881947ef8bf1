"""launcher.cluster: emulate: a run's N logical workers as threads of one process, running the
real training loop and strategies over an emulated process group, on the cluster's clock
(docs/emulation.md). Modules: settings (the config section, torch-free), scheduler (the
baton), process_group (the backend), clock (the cluster's clock and exchange costs), workers (the threads),
runner (one training run, a parameter server's shards as threads too)."""
