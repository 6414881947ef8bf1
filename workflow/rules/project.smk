# The performance model past the machine (dtstudy.projection.project): this machine's gloo
# benchmark, then every strategy of the study projected to projection.workers on
# projection.hardware, calibrated on the study's runs. docs/performance-model.md.
rule commbench:
    output:
        result="results/commbench/commbench.json",
    log:
        "results/logs/commbench.log",
    conda:
        "../../envs/study.yaml"
    # two processes measuring each other: both cores to itself, never beside a training run
    threads: 2
    params:
        # gloo's event loops as the training runs have them
        gloo_loop_nice=config["launcher"]["gloo_loop_nice"],
    shell:
        "python -m dtstudy project commbench --out {output.result}"
        " --gloo-loop-nice {params.gloo_loop_nice} > {log} 2>&1"


rule project:
    input:
        # calibrated on the runs the scaling table times
        metrics=throughput_runs(METRICS),
        commbench=rules.commbench.output.result,
        study_run=rules.aggregate.output.study_run,
    output:
        table="results/tables/projection.csv",
        table_md="results/tables/projection.md",
        table_page=report(
            "results/tables/projection.html", caption="../report/projection_table.rst", category="Scaling"
        ),
        plot=report("results/plots/projection.png", caption="../report/projection.rst", category="Scaling"),
    log:
        "results/logs/project.log",
    conda:
        "../../envs/study.yaml"
    params:
        config=config_json(["model", "strategies", "strategy_params", "stragglers", "projection"]),
    shell:
        "python -m dtstudy project study --config-json {params.config:q} --metrics {input.metrics}"
        " --commbench {input.commbench} --out {output.table} --out-md {output.table_md}"
        " --plot {output.plot} --study-run {input.study_run} > {log} 2>&1"
