# every file the preparation writes (dtstudy.data.prepare.prepared_files); meta.json, written last,
# marks a complete preparation
rule prepare_data:
    output:
        meta=f"{DATA_DIR}/meta.json",
        splits=[f"{DATA_DIR}/{name}" for name in prepared_files(config["dataset"]) if name != "meta.json"],
    log:
        "results/logs/prepare_data.log",
    conda:
        "../../envs/study.yaml"
    params:
        config=config_json(["dataset"]),
        out=folder_of("output", "meta"),
    shell:
        "python -m dtstudy prepare-data --config-json {params.config:q} --out {params.out} > {log} 2>&1"


# A local rule: it only creates the MLflow experiment (seconds), from the machine that
# certainly reaches the tracking server.
localrules:
    init_tracking,


rule init_tracking:
    output:
        marker=TRACKING_MARKER,
    log:
        "results/logs/init_tracking.log",
    conda:
        "../../envs/study.yaml"
    params:
        config=config_json(["tracking"]),
    shell:
        "python -m dtstudy init-tracking --config-json {params.config:q} --marker {output.marker} > {log} 2>&1"
