# The distributed-training study: prepare data -> train (one submitit job per
# strategy x N x seed) -> evaluate -> aggregate. See README.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


# common.smk validates the config (our schema validator, whose integers refuse 64.0, then the
# checks a schema cannot do) before anything else runs.
include: "workflow/rules/common.smk"
include: "workflow/rules/data.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/aggregate.smk"
include: "workflow/rules/project.smk"


# A SLURM study prints what it is predicted to cost before its first job (common.smk).
onstart:
    print_cost_summary()


# The study's warm pool (local runs) is not needed once Snakemake is done.
onsuccess:
    stop_warm_pool()


onerror:
    stop_warm_pool()


# An emulated study has no projection (common.smk, PROJECTS_THE_STUDY).
rule all:
    default_target: True
    input:
        rules.aggregate.output,
        rules.project.output if PROJECTS_THE_STUDY else [],
