"""The report as one self-contained HTML page, `report.html`, for MLflow's artifact viewer.

MLflow shows an HTML artifact in a sandboxed frame loaded from a blob, where a relative link to
another artifact leads nowhere, so the page carries everything itself: inline CSS, no script, the
plots embedded as `data:image/png;base64` images. It holds what the text report holds — the runs
table (`RUNS`), the speed-up ladder's table when there is one (`LADDER`), the Pareto front of a
sweep with two objectives (`accelexp.report.pareto`) with the runs it left out, the notes under a
table that say why a row's figure is blank, and every plot written — cells and notes worded by
the same `Layout`s as the markdown and rich tables, so the numbers read the same everywhere. All
text is escaped.
"""

from __future__ import annotations

import base64
import html
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from accelexp.record import FAILED, FINISHED
from accelexp.report.compare import Row
from accelexp.report.formats import LADDER, NOTES_HEADING, RUNS, Layout
from accelexp.report.ladder import LadderRow, ladder_subject
from accelexp.report.pareto import Front, notes

HTML_NAME = "report.html"
STYLE = """
body { font: 14px/1.4 system-ui, sans-serif; color: #222; margin: 1.5em; }
h1 { font-size: 1.4em; margin: 0 0 0.2em; }
h2 { font-size: 1.1em; margin: 1.6em 0 0.4em; }
p.sub { color: #555; margin: 0 0 1em; }
div.table { overflow-x: auto; }
table { border-collapse: collapse; font-variant-numeric: tabular-nums; }
th, td { padding: 0.25em 0.5em; border-bottom: 1px solid #ddd; white-space: nowrap; }
th { text-align: left; background: #f4f4f4; border-bottom: 2px solid #bbb; }
td.num, th.num { text-align: right; }
td:first-child, th:first-child { position: sticky; left: 0; background: #fff; }
th:first-child { background: #f4f4f4; }
tr.failed td { color: #b00020; }
tr.unfinished td { color: #8a6d00; }
p.notes { color: #444; margin: 0.8em 0 0.2em; }
ul.notes { color: #444; margin: 0; padding-left: 1.2em; }
figure { display: inline-block; margin: 0.5em 1em 0.5em 0; vertical-align: top; }
figure img { max-width: 100%; border: 1px solid #eee; }
figcaption { color: #666; font-size: 0.85em; }
"""


def _cell(tag: str, text: str, numeric: bool) -> str:
    align = ' class="num"' if numeric else ""
    return f"<{tag}{align}>{html.escape(text)}</{tag}>"


def _table(rows: Sequence[Any], layout: Layout) -> str:
    """The rows as an HTML table: the readable columns, cells as `layout.text` writes them;
    failed runs in red, runs that did not finish in amber. Wider than the page, it scrolls."""
    headers = layout.shown(rows)
    head = "".join(_cell("th", title, key in layout.numeric) for key, title in headers.items())
    body = []
    for row in rows:
        css = {FINISHED: "", FAILED: ' class="failed"'}.get(row.status, ' class="unfinished"')
        cells = "".join(
            _cell("td", layout.text(row, key), key in layout.numeric) for key in headers
        )
        body.append(f"<tr{css}>{cells}</tr>")
    table = f"<table><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    return f'<div class="table">{table}</div>'  # scrolls sideways, the run's name kept in view


def _notes(rows: Sequence[Any], layout: Layout) -> str:
    """The rows' notes (why a figure is blank: too short to measure, a comparison refused) as a
    list under the table, as `layout.notes` words them."""
    notes = layout.notes(rows)
    if not notes:
        return ""
    items = "".join(f"<li>{html.escape(note)}</li>" for note in notes)
    return f'<p class="notes">{html.escape(NOTES_HEADING)}</p><ul class="notes">{items}</ul>'


def _figure(path: Path) -> str:
    """A PNG embedded in the page, its file name under it."""
    data = base64.b64encode(path.read_bytes()).decode("ascii")
    name = html.escape(path.name)
    return (
        f'<figure><img src="data:image/png;base64,{data}" alt="{name}">'
        f"<figcaption>{name}</figcaption></figure>"
    )


def write_html(
    title: str,
    rows: Sequence[Row],
    out_dir: Path,
    ladder_rows: Sequence[LadderRow] = (),
    plots: Sequence[Path] = (),
    subtitle: str = "",
    front: Front | None = None,
    summary: str = "",
) -> Path:
    """Write `out_dir/report.html`: the title, the runs table, `summary` (a line about every
    run, e.g. `compare.everything_set_aside`) and the table's notes, the ladder's table
    and notes when there are ladder rows, the Pareto front's table and the runs it left out when
    there is a front, and the PNGs among `plots` embedded; its path."""
    sections = [
        f"<h1>{html.escape(title)}</h1>",
        f'<p class="sub">{html.escape(subtitle)}</p>' if subtitle else "",
        "<h2>Runs</h2>",
        _table(rows, RUNS),
        f'<p class="notes">{html.escape(summary)}</p>' if summary else "",
        _notes(rows, RUNS),
    ]
    if ladder_rows:
        sections += [
            f"<h2>Speed-up ladder: {html.escape(ladder_subject(ladder_rows))}</h2>",
            _table(ladder_rows, LADDER),
            _notes(ladder_rows, LADDER),
        ]
    if front:
        left_out = "".join(f"<li>{html.escape(note)}</li>" for note in notes(front))
        sections += [
            f"<h2>{html.escape(front.title)}</h2>",
            _table(front.rows, front.layout),
            f'<ul class="notes">{left_out}</ul>' if left_out else "",
        ]
    figures = [_figure(Path(p)) for p in plots if Path(p).suffix == ".png"]
    if figures:
        sections += ["<h2>Plots</h2>", *figures]
    page = (
        '<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
        f"<title>{html.escape(title)}</title><style>{STYLE}</style></head>\n"
        f"<body>\n{chr(10).join(s for s in sections if s)}\n</body></html>\n"
    )
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / HTML_NAME
    path.write_text(page, encoding="utf-8")
    return path
