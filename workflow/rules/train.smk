# Two kinds of run (dtstudy.config.run_kinds), two rules: train (accuracy runs, full
# trainings, in RUN_DIR) and train_scaling (scaling runs, warm-up + timed steps, in
# SCALING_RUN_DIR), the same command with its kind's run config.
# A local rule: it only submits the submitit job (locally one task that has the warm pool
# fork the run's processes, or a SLURM job) and blocks until it ends; Ctrl-C cancels the job.
# Locally it reserves one core per process of the run (train_threads); on SLURM it is a
# waiting process of one thread and the job has its own nodes. Emulated (launcher.cluster
# emulate), it submits nothing: the command is the run, its N logical workers threads of it, on
# EMULATED_RUN_THREADS cores.
localrules:
    train,
    train_scaling,


rule train:
    input:
        data=rules.prepare_data.output.meta,
        tracking=ancient(TRACKING_MARKER),
    output:
        metrics=f"{RUN_DIR}/{METRICS}",
        checkpoint=f"{RUN_DIR}/{MODEL}",
    log:
        "results/logs/train/{strategy}/n{workers}/seed{seed}.log",
    conda:
        "../../envs/study.yaml"
    threads: train_threads
    params:
        config=run_config_json(run_kinds.ACCURACY),
        operational=operational_json(run_kinds.ACCURACY),
        data=folder_of("input", "data"),
        out=folder_of("output", "metrics"),
        job_dir="results/logs/submitit/{strategy}/n{workers}/seed{seed}",
    shell:
        "python -m dtstudy train --config-json {params.config:q} --operational-json {params.operational:q}"
        " --strategy {wildcards.strategy}"
        " --workers {wildcards.workers} --seed {wildcards.seed} --data {params.data}"
        " --out {params.out} --job-dir {params.job_dir} > {log} 2>&1"


use rule train as train_scaling with:
    output:
        metrics=f"{SCALING_RUN_DIR}/{METRICS}",
        checkpoint=f"{SCALING_RUN_DIR}/{MODEL}",
    log:
        "results/logs/train/scaling/{strategy}/n{workers}/seed{seed}.log",
    params:
        config=run_config_json(run_kinds.SCALING),
        operational=operational_json(run_kinds.SCALING),
        data=folder_of("input", "data"),
        out=folder_of("output", "metrics"),
        job_dir="results/logs/submitit/scaling/{strategy}/n{workers}/seed{seed}",
