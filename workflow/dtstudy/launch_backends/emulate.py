"""launcher.cluster `emulate`: no job; the train command runs a run's N logical workers as
threads of its own process on the clock of the `emulate` section's hardware profile
(dtstudy.emulation). Its runs spread over the profile's nodes as a SLURM job's would."""

from __future__ import annotations

from dtstudy.launch_backends.base import LaunchBackend


class EmulateBackend(LaunchBackend):
    kind = "emulate"
    emulated = True


EMULATE = EmulateBackend()
