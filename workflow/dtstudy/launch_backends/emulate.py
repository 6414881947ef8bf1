"""launcher.cluster `emulate`: no job; the train command runs a run's N logical workers as
threads of its own process on the clock of the `emulate` section's hardware profile
(dtstudy.emulation). Its runs spread over the profile's nodes as a SLURM job's would. With
launcher.local_processes `pool` (the default) that process is forked by the study's warm pool
(dtstudy.launch.pool), which also scores each run's test split; with `tasks` it is the train
command's own."""

from __future__ import annotations

from dtstudy.launch_backends.base import LaunchBackend


class EmulateBackend(LaunchBackend):
    kind = "emulate"
    emulated = True
    own_keys = ("local_processes",)

    def uses_pool(self, launcher: dict) -> bool:
        # an emulated study is many short runs on this machine: a fresh interpreter would spend
        # seconds importing torch, MLflow and DDP's compiler for each run and each evaluation
        return launcher["local_processes"] == "pool"


EMULATE = EmulateBackend()
