"""The page: every section rendered into one self-contained HTML file, written with its PNGs."""

from __future__ import annotations

import base64
import html
import logging
import os
import re
import time
from collections.abc import Sequence
from typing import Any

from pipeline.report.data import RunData, load_run
from pipeline.report.plots import Section
from pipeline.report.sections import SECTION_TITLES, SECTIONS
from pipeline.store.storage import RunStore
from pipeline.store.urls import is_local, local_path

logger = logging.getLogger(__name__)

_CSS = """
body { font-family: system-ui, sans-serif; margin: 2em auto; max-width: 1300px; color: #222; }
h1 { margin-bottom: 0.2em; } h2 { border-bottom: 1px solid #ccc; padding-bottom: 0.2em; margin-top: 1.6em; }
table { border-collapse: collapse; margin: 0.6em 0; font-size: 0.9em; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.6em; text-align: left; vertical-align: top; }
th { background: #f3f3f3; } .nodata { color: #888; font-style: italic; } .warn { color: #a40; }
img { max-width: 100%; } .grid { display: flex; flex-wrap: wrap; gap: 0.4em; }
.grid figure { flex: 0 1 32%; margin: 0; } td.text { white-space: pre-wrap; font-family: monospace; max-width: 40em; }
details > summary { cursor: pointer; font-weight: 600; }
figcaption { color: #555; font-size: 0.85em; } nav a { margin-right: 1em; }
"""


def _anchor(title: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", title.lower()).strip("-")


def _build_sections(data: RunData) -> list[Section]:
    sections = []
    for build, title in zip(SECTIONS, SECTION_TITLES, strict=True):
        try:
            sections.append(build(data))
        except Exception as e:  # a malformed record must not cost the rest of the report
            logger.exception("report: section %r failed", title)
            sec = Section(title)
            sec.body.append(
                f'<p class="warn">section failed: {html.escape(type(e).__name__)}: {html.escape(str(e))}</p>'
            )
            sections.append(sec)
    return sections


def render_html(data: RunData, sections: Sequence[Section]) -> str:
    """The whole page, every plot embedded as a base64 PNG."""
    nav = "".join(f'<a href="#{_anchor(s.title)}">{html.escape(s.title)}</a>' for s in sections)
    parts = [
        "<!DOCTYPE html>",
        '<html lang="en"><head><meta charset="utf-8">',
        f"<title>rlpipe report: {html.escape(data.run_root)}</title><style>{_CSS}</style></head><body>",
        f"<h1>rlpipe run report</h1><p><code>{html.escape(data.run_root)}</code> — generated "
        f"{html.escape(time.strftime('%Y-%m-%d %H:%M:%S %Z'))}</p><nav>{nav}</nav>",
    ]
    for sec in sections:
        parts.append(f'<section id="{_anchor(sec.title)}"><h2>{html.escape(sec.title)}</h2>')
        parts.extend(sec.body)
        if sec.grid:
            parts.append('<div class="grid">')
        for plot in sec.plots:
            b64 = base64.b64encode(plot.png).decode()
            parts.append(
                f'<figure><img alt="{html.escape(plot.name)}" src="data:image/png;base64,{b64}">'
                f"<figcaption>{html.escape(plot.caption)}</figcaption></figure>"
            )
        if sec.grid:
            parts.append("</div>")
        parts.append("</section>")
    parts.append("</body></html>")
    return "\n".join(parts)


def default_out_dir(run_root: str) -> str:
    """`<run_root>/report`: a folder of a local run root, or the same prefix of a remote one (uploaded there)."""
    if is_local(run_root):
        return os.path.join(local_path(run_root), "report")
    return f"{run_root.rstrip('/')}/report"


def build_report(run_root: str, out_dir: str | None = None, storage_options: dict[str, Any] | None = None) -> str:
    """Write the report of `run_root` to `out_dir` and return the path of its `index.html`.

    Reads only the run root (local path or fsspec URL, with `storage_options` for its file
    system). `out_dir` may be local or an fsspec URL (opened with default options); its default is
    `default_out_dir(run_root)`, `<run_root>/report`, opened with the run root's `storage_options`. Sections
    without data say so; this never raises for missing data.
    """
    data = load_run(run_root, storage_options)
    sections = _build_sections(data)
    page = render_html(data, sections)
    out = out_dir or default_out_dir(run_root)
    out_store = RunStore(out, None if out_dir else storage_options)  # atomic writes, local or remote
    for sec in sections:
        for plot in sec.plots:
            out_store.put_unique(f"plots/{plot.name}.png", plot.png)
    out_store.put_unique("index.html", page.encode())
    path = out_store.full_path("index.html") if out_store.is_local else f"{out.rstrip('/')}/index.html"
    logger.info("report of %s written to %s", run_root, path)
    return str(path)
