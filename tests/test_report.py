"""The Snakemake report says what was measured: each plot's caption (workflow/report/*.rst)
names the interval, the seeds and the x axis its figure draws (dtstudy.analysis.figures), each
table's caption the intervals its Markdown names, and the Markdown pages (the tables,
findings.md, the projection's table) are in the report as HTML pages (dtstudy.analysis.pages).

A reader's words for each kind of interval, seeds and x axis are the regular expressions below:
a caption that names another one than its figure draws (a standard deviation under a plot of
95% CIs) fails."""

from __future__ import annotations

import re

import matplotlib.figure
import pytest
from conftest import REPO
from test_aggregate import SEEDS, THROUGHPUT, write_run

from dtstudy.analysis import pages, plots
from dtstudy.analysis.figures import DRAWN
from dtstudy.analysis.findings import accuracy_markdown, findings_markdown, scaling_markdown
from dtstudy.analysis.runs import load_run_metrics, load_runs
from dtstudy.analysis.tables import accuracy_table, noise_summary, scaling_table

INTERVAL_WORDS = {
    "std": r"standard deviation|\bstd\b",
    "sem": r"standard error",
    "bootstrap95": r"bootstrap 95% CI",
    "t95": r"\bt 95% CI",
    "range": r"range of 2 seeds",
    "band": r"\bband\b",
}
SEED_WORDS = {
    "pooled": r"pooled over (?:the )?seeds",
    "mean": r"mean over (?:the )?seeds(?! that)",
    "reached": r"mean over the seeds that reached",
    "lowest": r"lowest seed",
    "first": r"first seed",
    "runs_mean": r"runs' mean",
}
X_WORDS = {
    "workers": r"number of workers N|workers N\b",
    "training_time": r"training time",
    "epoch": r"per epoch",
    "wall": r"wall-clock",
}
RULE_FILES = [REPO / "workflow/rules/aggregate.smk", REPO / "workflow/rules/project.smk"]
REPORTED = re.compile(
    r'report\(\s*"(?P<path>[^"]+)",\s*caption="(?P<caption>[^"]+)",\s*category="(?P<category>[^"]+)"\s*\)'
)


def named(text: str, words: dict[str, str]) -> set[str]:
    """The kinds `text` names, by their words (whitespace as in running text)."""
    text = " ".join(text.split())
    return {kind for kind, pattern in words.items() if re.search(pattern, text)}


def reported() -> dict[str, tuple[str, str]]:
    """{output path: (its caption's text, its category)} of every report() output of the rules."""
    found = {}
    for rules in RULE_FILES:
        for match in REPORTED.finditer(rules.read_text()):
            caption = (rules.parent / match["caption"]).resolve()
            found[match["path"]] = (caption.read_text(), match["category"])
    return found


def test_every_figure_and_page_is_in_the_report_with_a_caption():
    outputs = reported()
    assert {f"results/plots/{name}.png" for name in DRAWN} <= set(outputs)
    pages_in_report = {path for path in outputs if path.endswith(".html")}
    assert pages_in_report == {
        f"results/tables/{name}.html" for name in ("findings", "scaling", "accuracy", "projection")
    }
    assert outputs["results/tables/findings.html"][1] == "Findings"


@pytest.mark.parametrize("name", list(DRAWN))
def test_a_figures_caption_names_the_interval_seeds_and_x_axis_it_draws(name):
    drawn = DRAWN[name]
    caption, _category = reported()[f"results/plots/{name}.png"]
    assert named(caption, INTERVAL_WORDS) == set(drawn.intervals), caption
    assert named(caption, SEED_WORDS) == {drawn.seeds}, caption
    assert named(caption, X_WORDS) == {drawn.x}, caption


@pytest.mark.parametrize("page, caption_of", [("scaling", "scaling.csv"), ("accuracy", "accuracy.csv")])
def test_a_tables_caption_names_the_intervals_its_markdown_names(tmp_path, page, caption_of):
    runs = load_runs(
        [write_run(tmp_path, strategy, workers, seed) for strategy, workers in THROUGHPUT for seed in SEEDS]
    )
    markdown = {
        "scaling": scaling_markdown(scaling_table(runs), noise_summary(runs)),
        "accuracy": accuracy_markdown(accuracy_table(runs)),
    }[page]
    outputs = reported()
    caption = outputs[f"results/tables/{caption_of}"][0]
    assert outputs[f"results/tables/{page}.html"][0] == caption  # the page and the CSV: one caption
    notes = "\n".join(line for line in markdown.splitlines() if not line.startswith("|"))
    assert named(caption, INTERVAL_WORDS) == named(notes, INTERVAL_WORDS) != set()


def figures_drawn(tmp_path, monkeypatch, seeds) -> dict[str, matplotlib.figure.Figure]:
    """The study's figures of hand-made runs with `seeds` seeds each, by name (their file's stem)."""
    saved = {}
    real_save = plots._save
    monkeypatch.setattr(
        plots, "_save", lambda figure, path: saved.setdefault(path.stem, figure) and real_save(figure, path)
    )
    run_dirs = [
        write_run(tmp_path, strategy, workers, seed, windows=[100.0 * workers + seed] * 5, top1=0.8 + seed / 100)
        for strategy in ("allreduce", "local_sgd")
        for workers in (1, 2)
        for seed in seeds
    ]
    plots.make_plots(load_runs(run_dirs), load_run_metrics(run_dirs), tmp_path / "plots")
    return saved


@pytest.mark.parametrize("seeds, spread", [((0, 1), "range"), ((0, 1, 2), "t95")])
@pytest.mark.slow
def test_each_figures_title_and_axes_say_what_it_draws(tmp_path, monkeypatch, seeds, spread):
    """The accuracy figures' bars are a range of 2 seeds or a t CI of 3: the title names the one
    drawn; the throughput's a bootstrap CI whatever the seeds; the x axis as declared."""
    figures = figures_drawn(tmp_path, monkeypatch, seeds)
    expected = {
        "throughput": {"bootstrap95"},
        "efficiency": {"bootstrap95"},
        "accuracy": {spread},
        "time_to_accuracy": {spread},
        "convergence": set(),
    }
    assert set(figures) == set(expected)
    for name, figure in figures.items():
        title = figure.get_suptitle()
        assert named(title, INTERVAL_WORDS) == expected[name], title
        assert named(title, SEED_WORDS) == {DRAWN[name].seeds}, title
        assert {ax.get_xlabel() for ax in figure.axes} == {DRAWN[name].x_label}


def test_the_pages_render_headings_lists_and_tables(tmp_path):
    runs = load_runs(
        [write_run(tmp_path, strategy, workers, seed) for strategy, workers in THROUGHPUT for seed in SEEDS]
    )
    findings = findings_markdown(scaling_table(runs), accuracy_table(runs), noise_summary(runs))
    page = pages.html_page(findings, "Findings")
    assert page.count("<h2>") == findings.count("\n## ") and "<h1>Findings</h1>" in page
    # a nested list: the ranking's rows inside its bullet
    assert re.search(r"<li>Efficiency at N=4 [^<]*\n<ul>\n<li>allreduce: E = ", page)
    assert page.count("<li>") == sum(1 for line in findings.splitlines() if line.lstrip().startswith("- "))
    scaling = scaling_markdown(scaling_table(runs), noise_summary(runs))
    table_page = pages.html_page(scaling, "Scaling table")
    body_rows = [line for line in scaling.splitlines() if line.startswith("|")][2:]
    assert table_page.count("<tr>") == 1 + len(body_rows) and "<th>images/s [95% CI]</th>" in table_page
    assert "<td>ps_sync</td>" in table_page
    md = tmp_path / "findings.md"
    md.write_text(findings)
    assert pages.write_page(md).read_text() == page


def test_the_projection_figures_title_and_axes_say_what_it_draws(tmp_path, monkeypatch):
    """Its band and the measured points' interval in the title, each profile's N in its own unit
    (processes on this machine's profile, GPUs elsewhere), a panel per family and profile."""
    from dtstudy.projection import project

    saved = []
    real = matplotlib.figure.Figure.savefig
    monkeypatch.setattr(
        matplotlib.figure.Figure, "savefig", lambda figure, *a, **kw: saved.append(figure) or real(figure, *a, **kw)
    )
    row = {
        "throughput": 100.0,
        "efficiency": 1.0,
        "throughput_low": 90.0,
        "throughput_high": 110.0,
        "efficiency_low": 0.9,
        "efficiency_high": 1.0,
        "measured_throughput": "",
        "measured_throughput_low": "",
        "measured_throughput_high": "",
    }
    rows = [
        {**row, "strategy": strategy, "workers": n, "profile": profile, "throughput": 100.0 * n}
        for profile in ("here", "there")
        for strategy in ("allreduce", "ps_sync", "no_exchange")
        for n in (1, 2, 4)
    ]
    rows[1] = {
        **rows[1],
        "measured_throughput": 180.0,
        "measured_throughput_low": 170.0,
        "measured_throughput_high": 190.0,
    }
    project.plot(rows, tmp_path / "projection.png", {"here": "processes on this machine", "there": "GPUs"}, ["range"])
    [figure] = saved
    title = figure.get_suptitle()
    assert named(title, INTERVAL_WORDS) == {"band", "range"} and named(title, SEED_WORDS) == {"runs_mean"}, title
    titles = [ax.get_title() for ax in figure.axes]
    assert titles == [
        "here: synchronous",
        "here: parameter server",
        "here: synchronous, efficiency",
        "here: parameter server, efficiency",
        "there: synchronous",
        "there: parameter server",
        "there: synchronous, efficiency",
        "there: parameter server, efficiency",
    ]
    labels = [ax.get_xlabel() for ax in figure.axes]
    assert (
        labels
        == [f"{DRAWN['projection'].x_label} (processes on this machine)"] * 4
        + [f"{DRAWN['projection'].x_label} (GPUs)"] * 4
    )
    # allreduce grey on the parameter servers' panel, beside ps_sync and the ceiling
    legend = [text.get_text() for text in figure.axes[1].get_legend().get_texts()]
    assert legend == ["ps_sync", "allreduce", "ceiling (no_exchange)"]
