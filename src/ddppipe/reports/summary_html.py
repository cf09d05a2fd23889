"""A run's summary (ddppipe.reports.summary) as a self-contained HTML fragment: the report's first
screen.

The report's landing page embeds it (workflow/report/workflow.rst), and it is a report item of
its own. Every line of the summary becomes a table row, whatever its label; a waste flag is
shown as a warning, and so is the cause of a failed run. Plain ASCII (other characters as
references), no external CSS or script.
"""

from __future__ import annotations

import html
import os

from ddppipe.core import atomic
from ddppipe.reports.summary import Summary

WARNING = "waste"  # the class of the rows shown as warnings
WARNINGS = (WARNING, "failed", "warning", "hung")  # the labels of the lines shown as warnings
_STYLE = (  # scoped to the fragment: it sits inside the report's page
    # dense, as a terminal's summary: the report's first screen holds it (tests/test_scaling.py)
    ".ddppipe-summary table{margin:0;font-size:0.85em;line-height:1.35}"
    ".ddppipe-summary th,.ddppipe-summary td{padding:1px 6px;vertical-align:top;text-align:left}"
    ".ddppipe-summary th{white-space:nowrap}"
    ".ddppipe-summary td{overflow-wrap:anywhere}"
    f".ddppipe-summary tr.{WARNING}{{background:#fef3c7;color:#78350f}}"
)


def _escape(text: str) -> str:
    return html.escape(text).encode("ascii", "xmlcharrefreplace").decode()


def _row(label: str, value: str) -> str:
    row = f' class="{WARNING}"' if label in WARNINGS else ""
    return f'<tr{row}><th scope="row">{_escape(label)}</th><td>{_escape(value)}</td></tr>'


def render(summary: Summary) -> str:
    """The summary as an HTML fragment: a heading (run and what it trained) and a table."""
    rows = "\n".join(_row(label, value) for label, value in summary.lines)
    return (
        f'<section class="ddppipe-summary" data-run="{_escape(summary.run)}">\n'
        f"<style>{_STYLE}</style>\n"
        f"<h3>run {_escape(summary.run)}: {_escape(summary.what)}</h3>\n"
        f"<table>\n<tbody>\n{rows}\n</tbody>\n</table>\n</section>\n"
    )


def write(summary: Summary, path: str | os.PathLike[str]) -> None:
    """Write the fragment to ``path`` atomically."""
    atomic.write_text(path, render(summary))
