"""gossip: each step, parameters averaged with ring or random neighbours. `spec` (torch-free:
knobs, checks, performance model) and `strategy` (the implementation)."""
