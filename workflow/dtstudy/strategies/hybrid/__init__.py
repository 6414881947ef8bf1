"""hybrid: data-parallel convolutions, fully connected layers split by output neuron over the
workers. `spec` (torch-free: knobs, checks, performance model) and `strategy` (the
implementation)."""
