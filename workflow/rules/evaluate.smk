rule evaluate:
    input:
        data=rules.prepare_data.output.meta,
        metrics=rules.train.output.metrics,
        checkpoint=rules.train.output.checkpoint,
    output:
        result=f"{RUN_DIR}/{EVALUATION}",
    log:
        "results/logs/evaluate/{strategy}/n{workers}/seed{seed}.log",
    conda:
        "../../envs/study.yaml"
    resources:
        **EVALUATE_RESOURCES,
    params:
        data=folder_of("input", "data"),
        run=folder_of("input", "metrics"),
        flags=EVALUATE_FLAGS,
    shell:
        "python -m dtstudy evaluate --run {params.run} --data {params.data} --out {output.result} {params.flags} > {log} 2>&1"
