"""allreduce: PyTorch DDP's bucketed all-reduce of the gradients, overlapped with backward. `spec`
(torch-free: knobs, checks, performance model) and `strategy` (the implementation)."""
