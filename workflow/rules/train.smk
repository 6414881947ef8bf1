# A local rule: it only submits the submitit job (locally one task that has the warm pool
# fork the run's processes, or a SLURM job) and blocks until it ends; Ctrl-C cancels the job.
# Locally it reserves one core per process of the run (train_threads); on SLURM it is a
# waiting process of one thread and the job has its own nodes.
localrules:
    train,


rule train:
    input:
        data=rules.prepare_data.output.meta,
        tracking=ancient(TRACKING_MARKER),
    output:
        metrics=f"{RUN_DIR}/metrics.json",
        checkpoint=f"{RUN_DIR}/model.pt",
    log:
        "results/logs/train/{strategy}/n{workers}/seed{seed}.log",
    params:
        config=run_config_json,
        data=folder_of("input", "data"),
        out=folder_of("output", "metrics"),
        job_dir="results/logs/submitit/{strategy}/n{workers}/seed{seed}",
    threads: train_threads
    conda:
        "../../envs/study.yaml"
    shell:
        "python -m dtstudy train --config-json {params.config:q} --strategy {wildcards.strategy}"
        " --workers {wildcards.workers} --seed {wildcards.seed} --data {params.data}"
        " --out {params.out} --job-dir {params.job_dir} > {log} 2>&1"
