"""The distributed training strategies, one folder per family (allreduce, compressed, hybrid,
parameter_server, local, gossip, reference), each with its torch-free `spec` (knobs, checks,
performance model) beside its `strategy` (the implementation). `specs` collects the specs by
name, `registry` the implementations; `spec` and `base` are their interfaces, `timing` the
device's clock every step time is read on."""
