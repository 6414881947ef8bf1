"""The distributed training strategies, one folder per family (allreduce, compressed, hybrid,
parameter_server, local, gossip, reference), each with its torch-free `spec` (knobs, checks,
performance model) beside its `strategy` (the implementation). `spec` and `base` are their
interfaces (the ground floor), `specs` collects the specs by name and `registry` the
implementations (the top floor); a strategy's name is typed once, in its spec."""
