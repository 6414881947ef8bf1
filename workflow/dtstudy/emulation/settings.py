"""The `emulate` config section, checked before any work starts (torch-free: the config check
runs when the Snakefile is parsed): which hardware profile gives the cluster's clock, one
GPU's training rate of the study's model on it, and which strategies can be emulated (each
strategy's spec says, StrategySpec.not_emulated_because)."""

from __future__ import annotations

from dataclasses import dataclass

from dtstudy.errors import ConfigError
from dtstudy.launch_backends.registry import launch_backend
from dtstudy.perfmodel.machine import Machine
from dtstudy.projection import hardware
from dtstudy.strategies.specs import SPECS


@dataclass(frozen=True)
class EmulatedCluster:
    """What the clock of an emulated run is made of."""

    profile: str  # the hardware profile's name
    machine: Machine
    images_per_s: float  # one GPU's training rate of the model (compute of a step = batch / it)
    rate_source: str
    #: where a parameter server's shards sit on this cluster (the profile's
    #: strategy_params.<strategy>.placement, else the hardware schema's default), by strategy
    placements: dict[str, str]

    def placement(self, strategy: str) -> str:
        return self.placements.get(strategy, hardware.default("placement"))


def emulated_cluster(config: dict) -> EmulatedCluster:
    """The cluster of `emulate.hardware`; ConfigError naming the key when it cannot time the
    study's model (no rate for it, or a profile whose links need this machine's benchmark)."""
    emulate = config["emulate"]
    profile = hardware.load_profile(emulate["hardware"], "emulate.hardware")
    if hardware.measured_here(profile):
        raise ConfigError(
            f"config key 'emulate.hardware': {emulate['hardware']!r} has intra_node: measured (this "
            "machine's communication benchmark), which an emulated run does not read yet; allowed: "
            "a profile whose intra_node gives its links (e.g. h100_ib400)"
        )
    machine, _ = hardware.study_machine(profile)
    model, precision = config["model"], config["train"]["precision"]
    rate = emulate["images_per_s"]
    source = "config key 'emulate.images_per_s'"
    if rate is None:
        rate = profile.get("train_images_per_s", {}).get(model, {}).get(precision)
        source = f"profile {profile['name']}: train_images_per_s.{model}.{precision}"
    if rate is None:
        raise ConfigError(
            f"config key 'emulate.images_per_s': null, and profile {profile['name']!r} "
            f"(emulate.hardware) has no train_images_per_s.{model}.{precision}; allowed: one GPU's "
            f"training rate of model {model!r} in images/s (a number > 0), or a profile that gives it"
        )
    placements = {
        name: knobs["placement"] for name, knobs in profile.get("strategy_params", {}).items() if "placement" in knobs
    }
    return EmulatedCluster(profile["name"], machine, float(rate), source, placements)


def check_emulate(config: dict) -> None:
    """launcher.cluster emulate: every strategy of the study can be emulated and the cluster
    can be timed. Raises ConfigError naming the key."""
    if not launch_backend(config).emulated:
        return
    for i, name in enumerate(config["strategies"]):
        why = SPECS[name].not_emulated_because
        if why:
            raise ConfigError(
                f"config key 'strategies[{i}]': strategy {name!r} is not yet emulated "
                f"(launcher.cluster: emulate): {why}; allowed with emulate: "
                f"{', '.join(sorted(n for n, s in SPECS.items() if not s.not_emulated_because))}"
            )
    emulated_cluster(config)
