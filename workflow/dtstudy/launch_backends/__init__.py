"""Launch backends: one module per value of launcher.cluster (`local`, `slurm`, `emulate`), each
an object with the same interface (`base.LaunchBackend`), chosen in one place (`registry`).
Torch-free and below every layer that asks them: the config's checks, the run spec, the
Snakefile's parse, the launcher on a login node."""
