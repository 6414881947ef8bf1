"""The documentation stays true: README.md's length, every relative link, no dated diary (no
ISO dates or commit hashes in the prose), every quoted measurement against the record it
names, every record's provenance, every default config/README.md quotes against the config
schema, and every value it quotes for a shipped config against that file. Torch-free and
quick: it reads files only (docs/README.md says how figures are quoted).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
README = REPO / "README.md"
CONFIG_README = REPO / "config" / "README.md"
SCHEMA = REPO / "workflow" / "schemas" / "config.schema.yaml"
REFERENCES = REPO / "docs" / "strategies.md"
README_MAX_LINES = 250

# Files the layout names that another part of the work writes; a link to one is checked once it exists.
PENDING = {"config/hardware/README.md"}


def doc_files() -> list[Path]:
    """The prose this test holds: README.md, every page under docs/, and config/README.md."""
    return [README, *sorted((REPO / "docs").rglob("*.md")), CONFIG_README]


def rel(path: Path) -> str:
    return path.relative_to(REPO).as_posix()


DOCS = [pytest.param(path, id=rel(path)) for path in doc_files()]


# ----- reading Markdown ---------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~)")
INDENTED_CODE = re.compile(r"^ {4,}\S")


def without_code_blocks(text: str) -> list[str]:
    """The lines of `text` with fenced and indented code blocks blanked (line numbers kept)."""
    lines, fenced, previous_blank, in_indented = [], False, True, False
    for line in text.split("\n"):
        if FENCE.match(line.strip()) and not line.startswith("    "):
            fenced = not fenced
            lines.append("")
            continue
        if fenced:
            lines.append("")
            continue
        in_indented = bool(INDENTED_CODE.match(line)) and (previous_blank or in_indented)
        lines.append("" if in_indented else line)
        previous_blank = not line.strip()
    return lines


def blocks(text: str) -> list[str]:
    """Paragraphs and list items joined into one line each, every table row a block of its own,
    code blocks left out: the units a figure and its marker are read in."""
    out, paragraph = [], []

    def flush():
        if paragraph:
            out.append(" ".join(part.strip() for part in paragraph))
            paragraph.clear()

    for line in without_code_blocks(text):
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            flush()
            if stripped:
                out.append(stripped)
        elif stripped.startswith("|"):
            flush()
            out.append(stripped)
        elif re.match(r"^([-*]|\d+\.)\s", stripped):
            flush()
            paragraph.append(stripped)
        else:
            paragraph.append(stripped)
    flush()
    return out


INLINE_CODE = re.compile(r"`[^`]*`")
LINK_TARGET = re.compile(r"\]\(([^)\s]+)\)")
URL = re.compile(r"https?://\S+")


# ----- README's size --------------------------------------------------------------------------


def test_the_readme_is_at_most_250_lines():
    lines = README.read_text().count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; at most {README_MAX_LINES}: move detail to docs/"


# ----- links -----------------------------------------------------------------------------------


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, code marks and punctuation dropped, spaces to '-'."""
    text = heading.strip().lstrip("#").strip().lower()
    text = re.sub(r"<!--.*?-->", "", text)
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(path: Path) -> set[str]:
    return {slug(line) for line in without_code_blocks(path.read_text()) if re.match(r"^#{1,6}\s", line)}


def links(text: str) -> list[str]:
    found = []
    for line in without_code_blocks(text):
        found += LINK_TARGET.findall(INLINE_CODE.sub("", line))
    return found


def broken_links(path: Path, text: str) -> list[str]:
    """The relative links of `text` (the file `path`) whose file or heading does not exist."""
    broken = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # http:, https:, mailto:
            continue
        file_part, _, anchor = target.partition("#")
        goal = (path.parent / file_part).resolve() if file_part else path
        where = goal.relative_to(REPO).as_posix() if goal.is_relative_to(REPO) else str(goal)
        if where.startswith("workflow/dtstudy"):
            broken.append(f"{target}: name modules in backticks instead of linking into the package")
            continue
        if not goal.exists():
            if where not in PENDING:
                broken.append(f"{target}: no file {where}")
            continue
        if anchor and goal.suffix == ".md" and anchor not in anchors(goal):
            broken.append(f"{target}: no heading '#{anchor}' in {where}")
    return broken


@pytest.mark.parametrize("path", DOCS)
def test_every_relative_link_resolves(path):
    broken = broken_links(path, path.read_text())
    assert not broken, f"{rel(path)}:\n" + "\n".join(broken)


def test_the_link_check_catches_a_missing_file_a_missing_heading_and_a_link_into_the_package():
    page = REPO / "docs" / "a-page.md"
    text = (
        "[ok](strategies.md#references) [gone](no-such-page.md) [anchor](strategies.md#no-such-heading) "
        "[module](../workflow/dtstudy/errors.py) `[in code](nowhere.md)` [web](https://example.org/x.md)\n"
    )
    assert len(broken_links(page, text)) == 3


# ----- no dated diary -------------------------------------------------------------------------

ISO_DATE = re.compile(r"\b\d{4}-\d{2}-\d{2}\b")
# 7 to 40 hex characters with at least one digit and one letter: a commit hash, not a word or a number
COMMIT = re.compile(r"\b(?=[0-9a-f]*\d)(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}\b")


@pytest.mark.parametrize("path", DOCS)
def test_no_dates_or_commit_hashes_in_the_prose(path):
    text = path.read_text()
    dates = ISO_DATE.findall(text)
    commits = COMMIT.findall(text)
    assert not dates and not commits, (
        f"{rel(path)}: dates {dates}, commit hashes {commits}: they belong in a record (docs/records/), not the prose"
    )


def test_the_date_and_commit_patterns_catch_a_diary():
    diary = "measured at e8b10ba on 2026-12-04, then at 0a17fd46562694cb961703acccfd479e813c552b"
    assert ISO_DATE.findall(diary) == ["2026-12-04"]
    assert COMMIT.findall(diary) == ["e8b10ba", "0a17fd46562694cb961703acccfd479e813c552b"]
    assert not COMMIT.findall("defaced 25557032 fp16 bf16 allreduce")


# ----- quoted measurements and their records --------------------------------------------------

RECORD_MARK = re.compile(r"<!--\s*record:\s*([^#\s]+)#(\S+?)\s*-->")
PUBLISHED_MARK = re.compile(r"<!--\s*published:\s*(.*?)\s*-->")
# a figure written right before its marker (bold allowed)
FIGURE = re.compile(
    r"(?:(?P<min>\d+) min (?P<sec>\d+) s"
    r"|(?P<count>\d+) of (?P<total>\d+)"
    r"|(?P<number>[+−-]?\d+(?:\.\d+)?)\s?(?P<unit>%|ms|µs|s|images/s)?)"
    r"\**\s*$"
)
# what looks like a measurement when no marker stands beside it
MEASURED = [
    re.compile(r"(?<![\w.])[+−-]?\d+(?:\.\d+)?\s?%"),
    re.compile(r"\d[\d,.]*\s?(?:images/s|img/s)"),
    re.compile(r"(?<![\w.])\d+(?:\.\d+)?(?:\s?(?:min|ms|µs|us)|\s(?:s|h))\b"),  # not 2s in (2s+1)
    re.compile(r"(?<![\w.])0\.\d{3,}\b"),
    re.compile(r"(?:top-1|top-5|accuracy)\W{1,3}(?:of\s|at\s)?0\.\d+\b"),
    re.compile(r"(?<![\w.])0\.\d+\s(?:test\s|validation\s)?top-[15]"),
]
# not measurements: a tolerance ("within 15%") and a confidence level ("95% CI", "t 95% interval")
NOT_MEASURED = [
    re.compile(r"within (?:about )?\d+(?:\.\d+)?\s?%"),
    re.compile(r"\d+(?:\.\d+)?\s?% tolerance"),
    re.compile(r"\d+%\s(?:CI|confidence|interval|bootstrap)"),
]


def reference_numbers() -> set[str]:
    section = REFERENCES.read_text().split("## References", 1)[1]
    return {number for number in re.findall(r"^(\d+)\.\s", section, flags=re.M)}


def record_value(path: str, dotted: str):
    value = json.loads((REPO / path).read_text())
    for key in dotted.split("."):
        if isinstance(value, list):
            value = value[int(key)]
        else:
            assert key in value, f"{path}: no key {key!r} on the way to {dotted!r}"
            value = value[key]
    return value


def figure_matches(figure: re.Match, value) -> bool:
    """Is the figure as written the record's value, rounded to the digits written?"""
    if figure["min"] is not None:
        return isinstance(value, (int, float)) and int(figure["min"]) * 60 + int(figure["sec"]) == round(value)
    if figure["count"] is not None:
        return value == [int(figure["count"]), int(figure["total"])]
    written = figure["number"].replace("−", "-")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    decimals = len(written.split(".")[1]) if "." in written else 0
    return math.isclose(round(value, decimals), float(written), abs_tol=10 ** -(decimals + 3))


def quoted_figures(text: str) -> tuple[list[str], list[str]]:
    """(problems with marked figures, unmarked numbers that look measured) of one document."""
    problems, unmarked = [], []
    known_references = reference_numbers()
    for block in blocks(text):
        plain = INLINE_CODE.sub("``", block)
        # marked figures: each checked, then taken out of what the unmarked scan sees
        for mark in RECORD_MARK.finditer(plain):
            before = re.sub(r"<!--.*?-->", "", plain[: mark.start()])
            figure = FIGURE.search(before)
            path, dotted = mark.groups()
            if figure is None:
                problems.append(
                    f"a marker with no figure before it: ...{before[-40:]!r} <!-- record: {path}#{dotted} -->"
                )
                continue
            if not (REPO / path).exists():
                problems.append(f"{figure.group(0)!r}: no record {path}")
                continue
            try:
                value = record_value(path, dotted)
            except (AssertionError, IndexError, ValueError) as error:
                problems.append(f"{figure.group(0)!r}: {error}")
                continue
            if not figure_matches(figure, value):
                problems.append(f"{figure.group(0).strip()!r} is not {path}#{dotted} = {value!r}")
        scan = plain
        for mark in reversed(list(RECORD_MARK.finditer(plain))):
            figure = FIGURE.search(re.sub(r"<!--.*?-->", "", plain[: mark.start()]))
            start = mark.start() - (len(figure.group(0)) if figure else 0)
            scan = scan[: max(start, 0)] + " FIGURE " + scan[mark.end() :]
        published = PUBLISHED_MARK.findall(scan)
        for source in published:
            cited = re.findall(r"\[(\d+)\]", source)
            if not cited or not set(cited) <= known_references:
                problems.append(f"published marker {source!r}: cite a numbered reference of docs/strategies.md")
        if published:
            continue  # figures from the literature, with their source
        scan = re.sub(r"<!--.*?-->", " ", scan)
        scan = LINK_TARGET.sub("]()", URL.sub(" ", scan))
        for pattern in NOT_MEASURED:
            scan = pattern.sub(" ", scan)
        for pattern in MEASURED:
            unmarked += [f"{hit.group(0)!r} in: {block[:100]}" for hit in pattern.finditer(scan)]
    return problems, unmarked


@pytest.mark.parametrize("path", DOCS)
def test_every_quoted_figure_matches_its_record_and_none_is_unmarked(path):
    problems, unmarked = quoted_figures(path.read_text())
    assert not problems, f"{rel(path)}:\n" + "\n".join(problems)
    assert not unmarked, (
        f"{rel(path)}: numbers that look measured, with no record marker "
        f"(docs/README.md, 'Quoting a figure'):\n" + "\n".join(unmarked)
    )


def test_the_figure_check_fails_a_drifted_or_unmarked_figure():
    record = "docs/records/studies.json#default.measurements.wall_time.seconds"
    seconds = record_value(*record.split("#"))
    right = f"It took {seconds // 60} min {seconds % 60} s<!-- record: {record} -->."
    assert quoted_figures(right) == ([], [])
    wrong = f"It took {seconds // 60 + 1} min {seconds % 60} s<!-- record: {record} -->."
    assert len(quoted_figures(wrong)[0]) == 1
    top1 = "docs/records/studies.json#default.measurements.allreduce_test_top1.by_n.4"
    value = record_value(*top1.split("#"))
    assert quoted_figures(f"allreduce reaches {value:.3f}<!-- record: {top1} -->.") == ([], [])
    assert len(quoted_figures(f"allreduce reaches {value + 0.01:.3f}<!-- record: {top1} -->.")[0]) == 1
    assert len(quoted_figures("allreduce reached 0.866 test top-1 in 12 min 50 s at 5954 images/s, +6.6%.")[1]) >= 4
    assert quoted_figures("every prediction within 15%, with its 95% CI") == ([], [])
    assert len(quoted_figures("about 90% efficiency <!-- published: [99] -->")[0]) == 1


RECORD_FILES = sorted((REPO / "docs" / "records").glob("*.json"))


def provenance_problems(where: str, entry: dict) -> list[str]:
    problems = [f"{where}: no {key!r}" for key in ("machine", "commit", "date", "first_reported") if key not in entry]
    if "what" not in entry and "command" not in entry:
        problems.append(f"{where}: say what was measured ('what' or 'command')")
    if "commit" in entry and not re.fullmatch(r"[0-9a-f]{7,40}", entry["commit"]):
        problems.append(f"{where}: commit {entry['commit']!r} is not a commit hash")
    if "date" in entry and not re.fullmatch(r"\d{4}-\d{2}-\d{2}", entry["date"]):
        problems.append(f"{where}: date {entry['date']!r} is not YYYY-MM-DD")
    machine = entry.get("machine", {})
    if not {"cpu", "cores"} <= set(machine):
        problems.append(f"{where}: machine needs 'cpu' and 'cores'")
    return problems


def test_every_study_record_carries_its_provenance():
    studies = json.loads((REPO / "docs" / "records" / "studies.json").read_text())
    problems = []
    for name, study in studies.items():
        if name == "about":
            continue
        if not (REPO / study.get("config", "-")).is_file():
            problems.append(f"{name}: config {study.get('config')!r} is not a file")
        for measured, entry in study["measurements"].items():
            problems += provenance_problems(f"{name}.{measured}", entry)
    assert not problems, "\n".join(problems)


def test_every_other_record_carries_its_provenance():
    records = json.loads((REPO / "docs" / "records" / "measurements.json").read_text())
    problems = []
    for name, entry in records.items():
        if name != "about":
            problems += provenance_problems(name, entry)
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("path", RECORD_FILES, ids=[path.name for path in RECORD_FILES])
def test_records_are_json(path):
    json.loads(path.read_text())


# ----- config/README.md against the schema ----------------------------------------------------


def load_schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text())


def schema_defaults(node: dict, prefix: str = "") -> dict[str, object]:
    """{dotted key: default} of every leaf key of the study schema (strategy_params apart)."""
    found = {}
    for key, sub in node.get("properties", {}).items():
        dotted = f"{prefix}{key}"
        if dotted == "strategy_params":
            continue
        if "properties" in sub:
            found.update(schema_defaults(sub, dotted + "."))
        else:
            found[dotted] = sub.get("default", "<no default>")
    return found


def knob_defaults() -> dict[tuple[str, str], object]:
    knobs = load_schema()["properties"]["strategy_params"]["properties"]
    return {
        (name, knob): sub.get("default", "<no default>")
        for name, knob_schema in knobs.items()
        for knob, sub in knob_schema.get("properties", {}).items()
    }


def cells(row: str) -> list[str]:
    return [cell.strip() for cell in row.strip().strip("|").split("|")]


def documented_defaults() -> dict[str, str]:
    """{dotted key: default as written} of every `| key | default | ...` table in config/README.md."""
    found, in_table = {}, False
    for line in CONFIG_README.read_text().split("\n"):
        if not line.startswith("|"):
            in_table = False
            continue
        row = cells(line)
        if row[:2] == ["key", "default"]:
            in_table = True
            continue
        if in_table and not set(row[0]) <= set("-: "):
            key = re.fullmatch(r"`([\w.]+)`", row[0])
            assert key, f"config/README.md: a key cell must be one `dotted.key`: {row[0]!r}"
            assert key[1] not in found, f"config/README.md: {key[1]} twice"
            found[key[1]] = row[1]
    return found


def documented_knob_defaults() -> dict[tuple[str, str], str]:
    """{(strategy, knob): default as written} of the knob table under `strategy_params`."""
    section = CONFIG_README.read_text().split("## `strategy_params`", 1)[1].split("\n## ", 1)[0]
    found, names = {}, []
    for line in section.split("\n"):
        if not line.startswith("|"):
            continue
        row = cells(line)
        if len(row) != 4 or not row[1].startswith("`"):
            continue  # the header and its rule
        names = re.findall(r"`(\w+)`", row[0]) or names  # an empty first cell: the row above's strategies
        for name in names:
            found[(name, row[1].strip("`"))] = row[2]
    return found


def as_written(cell: str):
    """A default cell, `value` in code marks, read as YAML."""
    match = re.fullmatch(r"`([^`]*)`", cell)
    assert match, f"a default must be written in code marks, as YAML: {cell!r}"
    return yaml.safe_load(match[1])


def same(a, b) -> bool:
    """Equal and of the same kind (true is not 1, 0 is 0.0)."""
    if isinstance(a, bool) or isinstance(b, bool):
        return type(a) is type(b) and a == b
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a == b
    return type(a) is type(b) and a == b


def test_every_default_config_readme_quotes_is_the_schemas():
    documented, in_schema = documented_defaults(), schema_defaults(load_schema())
    wrong = [
        f"{key}: README says {cell}, the schema {in_schema[key]!r}"
        for key, cell in documented.items()
        if key in in_schema and not same(as_written(cell), in_schema[key])
    ]
    assert not wrong, "config/README.md:\n" + "\n".join(wrong)


def test_config_readme_documents_every_key_of_the_schema_and_no_other():
    documented, in_schema = set(documented_defaults()), set(schema_defaults(load_schema()))
    assert not in_schema - documented, f"keys missing from config/README.md: {sorted(in_schema - documented)}"
    assert not documented - in_schema, f"config/README.md keys the schema lacks: {sorted(documented - in_schema)}"


def test_every_knob_default_config_readme_quotes_is_the_schemas():
    documented, in_schema = documented_knob_defaults(), knob_defaults()
    assert documented.keys() == in_schema.keys(), sorted(documented.keys() ^ in_schema.keys())
    wrong = [
        f"{name}.{knob}: README says {cell}, the schema {in_schema[(name, knob)]!r}"
        for (name, knob), cell in documented.items()
        if not same(as_written(cell), in_schema[(name, knob)])
    ]
    assert not wrong, "config/README.md's knob table:\n" + "\n".join(wrong)


def test_the_default_check_catches_a_drifted_default():
    in_schema = schema_defaults(load_schema())
    assert not same(as_written("`0.75`"), in_schema["target_accuracy"])
    assert not same(as_written("`12000`"), in_schema["dataset.subset"])
    assert not same(as_written("`1`"), in_schema["train.deterministic"])  # true, not 1
    assert same(as_written("`5.0e-4`"), in_schema["train.weight_decay"])


def deep_merge(base: dict, over: dict) -> dict:
    """`over` on top of `base`, mappings key by key (as Snakemake merges --configfile)."""
    merged = dict(base)
    for key, value in over.items():
        merged[key] = (
            deep_merge(merged[key], value) if isinstance(value, dict) and isinstance(merged.get(key), dict) else value
        )
    return merged


def config_value(config: dict, dotted: str):
    value = config
    for key in dotted.split("."):
        assert isinstance(value, dict) and key in value, f"the config does not set {dotted}"
        value = value[key]
    return value


def quoted_config_values() -> list[tuple[str, str, str]]:
    """(config file, dotted key, value as written) of every `key: value` code span that
    config/README.md quotes for a shipped config: in the paragraph of 'Passing a config' on
    what config/config.yaml sets, and in each row of 'Shipped configs' (that file over
    config/config.yaml)."""
    text = CONFIG_README.read_text()
    quoted = []
    passing = text.split("## Passing a config", 1)[1].split("\n## ", 1)[0]
    paragraph = next(part for part in passing.split("\n\n") if "`config/config.yaml` sets" in part)
    for span in re.findall(r"`([\w.]+: [^`]+)`", paragraph):
        key, value = span.split(": ", 1)
        quoted.append(("config.yaml", key, value))
    shipped = text.split("## Shipped configs", 1)[1].split("\n## ", 1)[0]
    for line in shipped.split("\n"):
        row = cells(line) if line.startswith("|") else []
        name = re.fullmatch(r"`([\w-]+\.yaml)`", row[0]) if row else None
        if name:
            for span in re.findall(r"`([\w.]+: [^`]+)`", row[1]):
                key, value = span.split(": ", 1)
                quoted.append((name[1], key, value))
    return quoted


def test_the_values_config_readme_quotes_for_the_shipped_configs_are_theirs():
    quoted = quoted_config_values()
    assert {name for name, _, _ in quoted} == {
        "config.yaml",
        "embedded-full.yaml",
        "allreduce.yaml",
        "hybrid.yaml",
        "cluster.yaml",
        "at-scale.yaml",
    }
    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    wrong = []
    for name, key, written in quoted:
        config = deep_merge(base, yaml.safe_load((REPO / "config" / name).read_text()))
        try:
            actual = config_value(config, key)
        except AssertionError as error:
            wrong.append(f"{name}: {error}")
            continue
        if not same(yaml.safe_load(written), actual):
            wrong.append(f"{name}: README says {key}: {written}, the file {actual!r}")
    assert not wrong, "config/README.md:\n" + "\n".join(wrong)


def test_config_readme_lists_exactly_the_operational_keys():
    """The keys config/README.md says can change mid-study without a rerun are the ones the
    rules pass apart (study_config.OPERATIONAL_KEYS): a key added to either alone fails."""
    from dtstudy.config.study_config import OPERATIONAL_KEYS

    section = CONFIG_README.read_text().split("## `launcher`", 1)[1].split("| key |", 1)[0]
    listed = set(re.findall(r"`([\w.]+)`", section))
    expected = {key for key in OPERATIONAL_KEYS["launcher"]} | {
        f"tracking.{key}" for key in OPERATIONAL_KEYS["tracking"]
    }
    assert listed == expected


def test_every_count_of_the_cluster_studys_jobs_is_the_configs():
    """The full-size study's training jobs, runs of each kind and strategies, wherever the docs
    and the config's own comment count them, are what config/cluster.yaml makes."""
    from dtstudy.config import run_kinds

    base = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config = deep_merge(base, yaml.safe_load((REPO / "config" / "cluster.yaml").read_text()))
    counts = {kind: run_kinds.run_count(config, kind) for kind in run_kinds.kinds_run(config)}
    expected = {
        "training jobs": sum(counts.values()),
        "scaling runs": counts["scaling"],
        "accuracy runs": counts["accuracy"],
        "strategies": len(config["strategies"]),
    }
    quoted = []
    for path in (
        REPO / "README.md",
        REPO / "docs" / "cluster.md",
        REPO / "docs" / "testing.md",
        REPO / "config" / "cluster.yaml",
    ):
        text = " ".join(path.read_text().split())
        counted = r"(\d+) (?:SLURM )?training jobs|(\d+) (scaling|accuracy) runs|(\d+) strategies other"
        for match in re.finditer(counted, text):
            what = "training jobs" if match[1] else f"{match[3]} runs" if match[2] else "strategies"
            quoted.append((path.name, what, int(match[1] or match[2] or match[4])))
    assert {name for name, _, _ in quoted} == {"README.md", "cluster.md", "testing.md", "cluster.yaml"}, quoted
    wrong = [
        f"{name} says {count} {what}, config/cluster.yaml makes {expected[what]}"
        for name, what, count in quoted
        if count != expected[what]
    ]
    assert not wrong, "\n".join(wrong)


def test_the_onebit_learning_rate_record_picks_each_best_rate_by_validation():
    """docs/strategies.md reads 1-bit's gap at each strategy's best rate: the record's best rate
    is the one with the best validation top-1 (not test), and the gap it quotes at that rate is
    the smaller of the two it records (at the shared rate the gap is larger, which the docs say)."""
    record = json.loads((REPO / "docs/records/studies.json").read_text())["onebit_learning_rate"]["measurements"]
    by_strategy = record["test_top1"]["by_strategy"]
    best = {name: max(rates, key=lambda rate: rates[rate]["val_top1"]) for name, rates in by_strategy.items()}
    assert best == record["best_rate"]["by_strategy"]
    assert best["allreduce"] == "base_lr_0_2"  # the default study's rate: its gap is read against allreduce at its best
    gaps = record["onebit_minus_allreduce"]
    assert gaps["at_shared_rate"]["value"] < gaps["at_onebit_best"]["value"] < 0
    assert gaps["at_onebit_best"]["high"] < 0  # a loss three seeds tell from zero, as the docs say
