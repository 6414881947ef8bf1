"""The distributed training strategies: `specs` (torch-free: each one's family, knobs, checks and
performance model), `registry` (name -> implementation), `base` (the interface) and one file
per family."""
