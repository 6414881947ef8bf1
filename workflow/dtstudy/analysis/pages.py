"""The study's Markdown (the tables' twins, findings.md, projection.md) as HTML pages for the
Snakemake report (`html_page`, `write_page`): the report shows an HTML file as a page but a
Markdown file only as a download. It renders the Markdown this package writes: headings,
paragraphs, nested bullet lists, pipe tables, **bold** and `code`."""

from __future__ import annotations

import html
import re
from pathlib import Path

from dtstudy.common.atomic_files import write_text

_STYLE = (
    "body{font-family:sans-serif;margin:1.5em;max-width:120em}table{border-collapse:collapse;font-size:90%}"
    "th,td{border:1px solid #ccc;padding:.2em .5em;text-align:left;white-space:nowrap}th{background:#eee}"
    "li{margin:.2em 0}"
)
_BULLET = re.compile(r"^( *)- (.*)$")


def _inline(text: str) -> str:
    text = html.escape(text, quote=False)
    text = re.sub(r"\*\*(.+?)\*\*", r"<strong>\1</strong>", text)
    return re.sub(r"`([^`]+)`", r"<code>\1</code>", text)


def _cells(line: str) -> list[str]:
    return [cell.strip() for cell in line.strip().strip("|").split("|")]


def _table(lines: list[str]) -> list[str]:
    """A pipe table: its header, the separator line (dropped), its rows."""
    header, rows = _cells(lines[0]), [_cells(line) for line in lines[2:]]
    out = ["<table>", "<tr>" + "".join(f"<th>{_inline(cell)}</th>" for cell in header) + "</tr>"]
    out += ["<tr>" + "".join(f"<td>{_inline(cell)}</td>" for cell in row) + "</tr>" for row in rows]
    return out + ["</table>"]


def _list(lines: list[str]) -> list[str]:
    """Bullet items, nested by their indentation."""
    out, depths = [], []
    for line in lines:
        indent, text = _BULLET.match(line).groups()
        depth = len(indent)
        if not depths or depth > depths[-1]:
            out.append("<ul>")
            depths.append(depth)
        else:
            out.append("</li>")
            while depth < depths[-1]:
                out += ["</ul>", "</li>"]
                depths.pop()
        out.append(f"<li>{_inline(text)}")
    for _ in depths:
        out += ["</li>", "</ul>"]
    return out


def _blocks(markdown: str) -> list[tuple[str, list[str]]]:
    """(kind, lines) of each block: heading, table, list or paragraph."""
    blocks: list[tuple[str, list[str]]] = []
    for line in markdown.splitlines():
        kind = (
            "blank"
            if not line.strip()
            else "heading"
            if line.startswith("#")
            else "table"
            if line.lstrip().startswith("|")
            else "list"
            if _BULLET.match(line)
            else "paragraph"
        )
        if kind == "list" and blocks and blocks[-1][0] == "paragraph" and line.startswith(" "):
            kind = "paragraph"  # an indented continuation line
        if blocks and blocks[-1][0] == kind and kind in ("table", "list", "paragraph"):
            blocks[-1][1].append(line)
        elif kind != "blank":
            blocks.append((kind, [line]))
        else:
            blocks.append(("blank", []))
    return [block for block in blocks if block[0] != "blank"]


def html_page(markdown: str, title: str) -> str:
    """A standalone HTML page of `markdown`, titled `title`."""
    body = []
    for kind, lines in _blocks(markdown):
        if kind == "heading":
            level = len(lines[0]) - len(lines[0].lstrip("#"))
            body.append(f"<h{level}>{_inline(lines[0][level:].strip())}</h{level}>")
        elif kind == "table":
            body += _table(lines)
        elif kind == "list":
            body += _list(lines)
        else:
            body.append(f"<p>{_inline(' '.join(line.strip() for line in lines))}</p>")
    return (
        '<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>'
        + html.escape(title)
        + "</title><style>"
        + _STYLE
        + "</style></head><body>\n"
        + "\n".join(body)
        + "\n</body></html>\n"
    )


def write_page(markdown_path: str | Path) -> Path:
    """`<name>.html` beside the Markdown file `<name>.md`, its title the file's first heading."""
    markdown_path = Path(markdown_path)
    markdown = markdown_path.read_text()
    heading = next(
        (line.lstrip("#").strip() for line in markdown.splitlines() if line.startswith("#")), markdown_path.stem
    )
    path = markdown_path.with_suffix(".html")
    write_text(path, html_page(markdown, heading))
    return path
