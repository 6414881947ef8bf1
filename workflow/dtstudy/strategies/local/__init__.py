"""Local SGD and EASGD: workers that train alone and average every `period` steps. `spec` (torch-
free: knobs, checks, performance model) and `strategy` (the implementations)."""
