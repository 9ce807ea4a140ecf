"""compare.html: several runs' curves overlaid, one plot per metric, in one self-contained page.

Runs are labelled by their directory names (with the parent folder added when two names clash).
A run without a metric is left out of that plot; a metric no run logged gets a note.
"""

from __future__ import annotations

import json
from html import escape
from pathlib import Path
from typing import Any, Sequence

from grpolab.report.html import (figure_html, fmt_value, load_rows, plot_sections, render_page,
                                 write_atomic)
from grpolab.report.plots import has_data, render_overlay
from grpolab.report.schema import describe, reward_fn_names


def run_labels(run_dirs: Sequence[Path]) -> list[str]:
    """Directory names, made unique by prefixing the parent folder (then an index) on clashes."""
    names = [p.resolve().name for p in run_dirs]
    labels = [f"{p.resolve().parent.name}/{p.resolve().name}" if names.count(n) > 1 else n
              for p, n in zip(run_dirs, names)]
    return [f"{lab} ({i})" if labels.count(lab) > 1 else lab for i, lab in enumerate(labels)]


def compare_keys(runs: Sequence[tuple[str, list[dict[str, Any]]]]) -> list[str]:
    """The metric keys to overlay: the report's plotted keys, in report order."""
    names = reward_fn_names(k for _, rows in runs for r in rows for k in r)
    keys: list[str] = []
    for _, specs in plot_sections(names):
        for spec in specs:
            keys += [s.key for s in spec.series if s.key not in keys]
            if spec.total_key and spec.total_key not in keys:
                keys.append(spec.total_key)
    return keys


def _final_table(runs: Sequence[tuple[str, list[dict[str, Any]]]],
                 evals: Sequence[dict[str, Any] | None]) -> str:
    """Last logged value of the headline metrics per run, plus eval 'after' accuracy."""
    cols = [k for k in ("reward/mean", "accuracy", "kl", "entropy", "len/mean", "time/step_s")
            if any(has_data(rows, k) for _, rows in runs)]
    head = "<tr><th>run</th><th>steps</th>" + "".join(f"<th>{escape(k)} (last)</th>"
                                                      for k in cols)
    with_eval = any(e for e in evals)
    head += "<th>eval accuracy before → after</th></tr>" if with_eval else "</tr>"
    trs = []
    for (label, rows), ev in zip(runs, evals):
        last = rows[-1] if rows else {}
        tds = [f"<td>{escape(label)}</td>", f'<td class="num">{len(rows)}</td>']
        tds += [f'<td class="num">{fmt_value(last.get(k))}</td>' for k in cols]
        if with_eval:
            b, a = (_get((ev or {}).get(when), "accuracy") for when in ("before", "after"))
            tds.append(f'<td class="num">{fmt_value(b)} → {fmt_value(a)}</td>')
        trs.append("<tr>" + "".join(tds) + "</tr>")
    return (f'<table class="sortable" id="compare-table"><thead>{head}</thead>'
            f'<tbody>{"".join(trs)}</tbody></table>')


def _get(d: Any, key: str) -> Any:
    return d.get(key) if isinstance(d, dict) else None


def _load_eval(run_dir: Path) -> dict[str, Any] | None:
    path = run_dir / "eval.json"
    if not path.exists():
        return None
    try:
        ev = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    return ev if isinstance(ev, dict) else None


def write_compare(run_dirs: Sequence[str | Path], out_path: str | Path) -> Path:
    """Writes one HTML page overlaying the runs' curves; returns out_path."""
    dirs = [Path(d) for d in run_dirs]
    if not dirs:
        raise ValueError("compare: give at least one run directory")
    for d in dirs:
        if not d.is_dir():
            raise FileNotFoundError(f"compare: run directory {d} does not exist")
    runs = list(zip(run_labels(dirs), (load_rows(d) for d in dirs)))
    evals = [_load_eval(d) for d in dirs]
    body = [f"<h1>grpolab comparison: {len(dirs)} runs</h1>",
            "<ul>" + "".join(f"<li><b>{escape(label)}</b>: {escape(str(d))}"
                             + ("" if rows else ' <span class="note">(no metrics)</span>') + "</li>"
                             for (label, rows), d in zip(runs, dirs)) + "</ul>",
            "<h2>Final values</h2>", _final_table(runs, evals), "<h2>Curves</h2>"]
    figs, missing = [], []
    for key in compare_keys(runs):
        spec = describe(key)
        img = render_overlay(runs, key, key, spec.unit if spec else "")
        if img is None:
            missing.append(key)
        else:
            figs.append(figure_html(img, [key]))
    body.append(f'<div class="grid">{"".join(figs)}</div>' if figs
                else '<p class="note">No run has any metrics to plot.</p>')
    if missing:
        body.append(f'<p class="note">Not logged by any run: {escape(", ".join(missing))}.</p>')
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    return write_atomic(out, render_page("grpolab comparison", "".join(body)))
