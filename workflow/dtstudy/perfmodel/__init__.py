"""The performance model's vocabulary, with no strategy in it: machines and workloads
(`machine`), collectives (`collectives`), what barriers wait for (`waits`) and the step
formulas by kind of exchange (`steps`). Each strategy's spec (dtstudy.strategies.specs)
composes its step from these; dtstudy.projection projects them past the machine."""
