"""launcher.cluster `emulate`: no job; the train command runs a run's N logical workers as
threads of its own process on the clock of the `emulate` section's hardware profile
(dtstudy.emulation). Its runs spread over the profile's nodes as a SLURM job's would. Their
evaluations are scored in the study's warm pool (dtstudy.launch.pool)."""

from __future__ import annotations

from dtstudy.launch_backends.base import LaunchBackend


class EmulateBackend(LaunchBackend):
    kind = "emulate"
    emulated = True

    def evaluates_in_pool(self, launcher: dict) -> bool:
        # a run's evaluation is a second of work after seconds of interpreter start and imports,
        # paid once a run: an emulated study is many short runs on this machine
        return True


EMULATE = EmulateBackend()
