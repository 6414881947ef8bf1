rule aggregate:
    input:
        # both kinds of run; the evaluation of the tested ones (accuracy runs)
        metrics=all_runs(METRICS),
        evals=all_runs(EVALUATION, tested_only=True),
    output:
        scaling=report("results/tables/scaling.csv", caption="../report/scaling.rst", category="Tables"),
        scaling_md="results/tables/scaling.md",
        accuracy=report("results/tables/accuracy.csv", caption="../report/accuracy_table.rst", category="Tables"),
        accuracy_md="results/tables/accuracy.md",
        findings="results/tables/findings.md",
        # the Markdown above as pages of the report (dtstudy.analysis.pages)
        findings_page=report("results/tables/findings.html", caption="../report/findings.rst", category="Findings"),
        scaling_page=report("results/tables/scaling.html", caption="../report/scaling.rst", category="Tables"),
        accuracy_page=report("results/tables/accuracy.html", caption="../report/accuracy_table.rst", category="Tables"),
        throughput_plot=report("results/plots/throughput.png", caption="../report/throughput.rst", category="Scaling"),
        efficiency_plot=report("results/plots/efficiency.png", caption="../report/efficiency.rst", category="Scaling"),
        accuracy_plot=report("results/plots/accuracy.png", caption="../report/accuracy.rst", category="Accuracy"),
        time_to_accuracy_plot=report(
            "results/plots/time_to_accuracy.png", caption="../report/time_to_accuracy.rst", category="Accuracy"
        ),
        convergence_plot=report(
            "results/plots/convergence.png", caption="../report/convergence.rst", category="Accuracy"
        ),
        # where the MLflow study run is: the projection adds its table and plot to it
        study_run="results/mlflow.study_run.json",
    log:
        "results/logs/aggregate.log",
    conda:
        "../../envs/study.yaml"
    params:
        config=config_json(),
        runs=folders_of_inputs("metrics"),
        tables=folder_of("output", "scaling"),
        plots=folder_of("output", "throughput_plot"),
    shell:
        "python -m dtstudy aggregate --config-json {params.config:q} --runs {params.runs}"
        " --tables {params.tables} --plots {params.plots} --study-run {output.study_run} > {log} 2>&1"
