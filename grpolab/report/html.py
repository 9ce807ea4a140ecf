"""report.html: one self-contained page (no external resources) describing a run directory.

Sections: run summary, metric plots (matplotlib PNGs embedded as base64), the before/after
evaluation table from eval.json, the resolved config, and the rollout inspector. Missing
optional files or metrics degrade to a note; a malformed file raises ValueError naming it.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from html import escape
from pathlib import Path
from typing import Any, Sequence

from grpolab.report.inspector import render_inspector
from grpolab.report.metrics import METRICS_FILE, read_metrics
from grpolab.report.plots import PlotSpec, Series, dedupe_by_step, has_data, render_plot
from grpolab.report.schema import METRIC_BY_KEY, describe, reward_fn_names

REPORT_FILE = "report.html"

CSS = """
body { font-family: system-ui, -apple-system, Segoe UI, Roboto, sans-serif; margin: 1.5em auto;
       max-width: 1180px; padding: 0 1em; color: #1d1d1f; }
h1 { font-size: 1.5em; }
h2 { border-bottom: 1px solid #ddd; padding-bottom: .2em; margin-top: 1.6em; }
h3 { margin-bottom: .3em; } h4 { margin: .8em 0 .3em; font-size: .95em; }
.grid { display: flex; flex-wrap: wrap; gap: 10px; }
figure { margin: 0; border: 1px solid #e3e3e3; border-radius: 4px; padding: 4px; }
figure img { display: block; width: 540px; max-width: 100%; }
figcaption { font-size: .75em; color: #555; max-width: 540px; }
.note { color: #777; font-style: italic; }
.flag { color: #a15c00; font-weight: 600; }
table { border-collapse: collapse; font-size: .85em; margin: .3em 0 1em; }
th, td { border: 1px solid #ddd; padding: 3px 7px; vertical-align: top; text-align: left; }
th { background: #f4f4f6; }
td.num { text-align: right; font-variant-numeric: tabular-nums; white-space: nowrap; }
table.sortable th { cursor: pointer; user-select: none; }
table.sortable th[aria-sort=ascending]::after { content: " \\25B2"; }
table.sortable th[aria-sort=descending]::after { content: " \\25BC"; }
pre, code { font-family: ui-monospace, SFMono-Regular, Menlo, Consolas, monospace;
            font-size: 12.5px; }
pre { white-space: pre-wrap; word-break: break-word; margin: 0; }
pre.prompt { background: #f6f8fa; padding: 6px; border-radius: 4px; }
pre.comp { max-width: 640px; max-height: 16em; overflow: auto; }
.group { border-left: 3px solid #8ab; padding-left: 10px; margin-bottom: 1.2em; }
.meta { font-size: .8em; color: #555; margin: .2em 0; }
.episode { max-width: 640px; max-height: 32em; overflow: auto; }
.ep-stats { font-size: .8em; color: #555; margin-bottom: .3em; }
.seg { border-left: 3px solid #ccc; background: #f6f8fa; padding: 2px 6px; margin: 3px 0; }
.seg-policy { border-left-color: #2e8b57; background: #e3f4e8; }
.seg-label { display: block; font-size: .75em; color: #555; }
details.seg summary { cursor: pointer; }
select { font-size: 1em; }
"""

SCRIPT = """
function grpolabSort(table, col, th) {
  const body = table.tBodies[0];
  const rows = Array.from(body.rows);
  const asc = th.getAttribute('aria-sort') !== 'ascending';
  table.querySelectorAll('th').forEach(h => h.removeAttribute('aria-sort'));
  th.setAttribute('aria-sort', asc ? 'ascending' : 'descending');
  const key = r => {
    const c = r.cells[col];
    if (c === undefined) return '';
    const v = c.getAttribute('data-v');
    return v === null ? c.textContent : (v === '' ? NaN : parseFloat(v));
  };
  rows.sort((a, b) => {
    const x = key(a), y = key(b);
    if (typeof x === 'number' && typeof y === 'number') {
      if (isNaN(x) || isNaN(y)) return isNaN(x) - isNaN(y);  // nulls last either way
      return asc ? x - y : y - x;
    }
    const d = String(x).localeCompare(String(y));
    return asc ? d : -d;
  });
  rows.forEach(r => body.appendChild(r));
}
document.addEventListener('DOMContentLoaded', () => {
  const sel = document.getElementById('step-select');
  const show = v => document.querySelectorAll('.step-panel').forEach(p => {
    p.hidden = p.getAttribute('data-step') !== v; });
  if (sel) { sel.addEventListener('change', () => show(sel.value)); show(sel.value); }
  document.querySelectorAll('table.sortable').forEach(table => {
    Array.from(table.tHead.rows[0].cells).forEach((th, i) =>
      th.addEventListener('click', () => grpolabSort(table, i, th)));
  });
});
"""


def render_page(title: str, body: str) -> str:
    """A complete HTML document with the shared CSS and the inspector/sorting script inline."""
    stamp = _dt.datetime.now().strftime("%Y-%m-%d %H:%M")
    return (f'<!DOCTYPE html>\n<html lang="en"><head><meta charset="utf-8">'
            f'<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{escape(title)}</title><style>{CSS}</style></head><body>"
            f"{body}<p class=\"note\">written by grpolab on {stamp}</p>"
            f"<script>{SCRIPT}</script></body></html>\n")


def _s(key: str, label: str | None = None, std: bool = False) -> Series:
    return Series(key, label or key, key.removesuffix("/mean") + "/std" if std else None)


def plot_sections(reward_names: Sequence[str], proxy_names: Sequence[str] = ()) -> list[tuple[str, list[PlotSpec]]]:
    """The report's plots, grouped into titled sections. proxy_names: rewards with a `pair_acc/NAME`
    series (proxies of a verifier, e.g. learned reward models: how well they rank the policy's samples)."""
    per_fn = [PlotSpec(f"reward: {n}", (_s(f"reward/{n}/mean", "mean ± std", std=True),),
                       "reward") for n in reward_names]
    if proxy_names:  # over-optimization (Gao et al. 2022): the proxy climbing while the gold does not
        per_fn.append(PlotSpec("proxy vs gold reward", tuple(_s(f"reward/{n}/mean", f"proxy: {n}") for n in proxy_names)
                               + (_s("accuracy", "gold: verifier accuracy"),), "reward"))
        per_fn.append(PlotSpec("proxy rewards vs the verifier: pair accuracy on the policy's samples",
                               tuple(_s(f"pair_acc/{n}", n) for n in proxy_names), "fraction"))
    return [
        ("Reward", [PlotSpec("combined reward", (_s("reward/mean", "mean ± std", std=True),),
                             "reward"), *per_fn,
                    PlotSpec("accuracy (verifiable rows)", (_s("accuracy"),), "fraction")]),
        ("Policy update", [
            PlotSpec("KL to reference", (_s("kl"),), "nats/token"),
            PlotSpec("clip fraction", (_s("clip/low_frac", "low (1-ε)"),
                                       _s("clip/high_frac", "high (1+ε)")), "fraction of tokens"),
            PlotSpec("entropy", (_s("entropy"),), "nats/token"),
            PlotSpec("importance ratio", (_s("ratio/mean", "mean"), _s("ratio/min", "min"),
                                          _s("ratio/max", "max")), "π_new / π_old"),
            PlotSpec("advantage", (_s("adv/mean", "mean"), _s("adv/min", "min"),
                                   _s("adv/max", "max")), "advantage"),
            PlotSpec("loss", (_s("loss"),), "loss"),
            PlotSpec("gradient norm", (_s("grad_norm"),), "L2 norm"),
            PlotSpec("learning rate", (_s("lr"),), "lr")]),
        ("Rollouts", [
            PlotSpec("completion length", (_s("len/mean", "mean"), _s("len/max", "max")), "tokens"),
            PlotSpec("degenerate rollouts", (_s("len/truncated_frac", "truncated"),
                                             _s("groups/zero_std_frac", "zero-std groups")),
                     "fraction")]),
        ("Speed", [
            PlotSpec("throughput", (_s("tokens_per_s/rollout", "rollout"),
                                    _s("tokens_per_s/learn", "learn")), "tokens/s"),
            PlotSpec("phase times", (_s("time/rollout_s", "rollout"), _s("time/score_s", "score"),
                                     _s("time/logprob_s", "log-probs"),
                                     _s("time/learn_s", "learn")),
                     "seconds per step", stacked=True, total_key="time/step_s"),
            PlotSpec("model FLOP utilisation", (_s("mfu"),), "fraction of peak")]),
    ]


def figure_html(img: str, spec_keys: Sequence[str]) -> str:
    caps = []
    for k in spec_keys:
        d = describe(k)
        caps.append(f"<b>{escape(k)}</b>: {escape(d.description)} [{escape(d.unit)}]" if d
                    else f"<b>{escape(k)}</b>")
    return (f'<figure><img alt="{escape(", ".join(spec_keys))}" src="data:image/png;base64,{img}">'
            f'<figcaption>{"<br>".join(caps)}</figcaption></figure>')


def render_plots(rows: list[dict[str, Any]]) -> str:
    """All plot sections for one run's (deduped) rows; keys never logged are listed in a note."""
    out, missing, used = [], [], {"step"}
    keys = list(dict.fromkeys(k for r in rows for k in r))
    proxies = [k.removeprefix("pair_acc/") for k in keys if k.startswith("pair_acc/")]
    for title, specs in plot_sections(reward_fn_names(keys), proxies):
        figs = []
        for spec in specs:
            keys = [s.key for s in spec.series] + ([spec.total_key] if spec.total_key else [])
            used.update(keys + [s.std_key for s in spec.series if s.std_key])
            img = render_plot(rows, spec)
            if img is None:
                missing.append(spec.title)
            else:
                figs.append(figure_html(img, keys))
        if figs:
            out.append(f'<h3>{escape(title)}</h3><div class="grid">{"".join(figs)}</div>')
    extra = sorted({k for r in rows for k in r} - used - set(METRIC_BY_KEY))
    extra_figs = [figure_html(img, [k]) for k in extra
                  if has_data(rows, k) and (img := render_plot(rows, PlotSpec(k, (_s(k),))))]
    if extra_figs:
        out.append(f'<h3>Other logged metrics</h3><div class="grid">{"".join(extra_figs)}</div>')
    if missing:
        out.append(f'<p class="note">Not logged in this run (no plot): '
                   f'{escape(", ".join(missing))}.</p>')
    return "".join(out)


def fmt_value(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}" if math.isfinite(v) else "–"
    return "–" if v is None else escape(str(v))


def render_summary(rows: list[dict[str, Any]]) -> str:
    """A small table: steps, first/last combined reward and accuracy, total time."""
    first, last = rows[0], rows[-1]
    cells = [("steps logged", f"{len(rows)} (step {first['step']} → {last['step']})")]
    for key in ("reward/mean", "accuracy", "kl", "len/mean"):
        if has_data(rows, key):
            cells.append((key, f"{fmt_value(first.get(key))} → {fmt_value(last.get(key))}"))
    for key in ("skipped_steps", "reward_errors"):
        if last.get(key):
            cells.append((key, f'<span class="flag">{fmt_value(last[key])}</span>'))
    times = [r["time/step_s"] for r in rows if isinstance(r.get("time/step_s"), (int, float))]
    if times:
        total = sum(times)
        cells.append(("total step time", f"{total:.1f} s ({total / len(times):.2f} s/step)"))
    return "<table>" + "".join(f"<tr><th>{escape(k)}</th><td>{v}</td></tr>"
                               for k, v in cells) + "</table>"


def render_eval(path: Path) -> str:
    """The before/after evaluation table (+ reward weights and reward-model accuracies)."""
    if not path.exists():
        return f'<p class="note">No evaluation: {escape(path.name)} was not written.</p>'
    try:
        ev = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}:{e.lineno}: invalid JSON ({e.msg})") from None
    if not isinstance(ev, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(ev).__name__}")
    before, after = ev.get("before") or {}, ev.get("after") or {}
    if not isinstance(before, dict) or not isinstance(after, dict):
        raise ValueError(f"{path}: 'before' and 'after' must be objects of metric -> value")
    parts = []
    keys = list(before) + [k for k in after if k not in before]
    if keys:
        trs = []
        for k in keys:
            b, a = before.get(k), after.get(k)
            num = all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b))
            delta = f"{a - b:+.4g}" if num else "–"
            trs.append(f'<tr><th>{escape(k)}</th><td class="num">{fmt_value(b)}</td>'
                       f'<td class="num">{fmt_value(a)}</td><td class="num">{delta}</td></tr>')
        parts.append('<table id="eval-table"><thead><tr><th>metric</th><th>before</th>'
                     '<th>after</th><th>change</th></tr></thead>'
                     f'<tbody>{"".join(trs)}</tbody></table>')
    else:
        parts.append('<p class="note">eval.json has no before/after metrics.</p>')
    rewards = ev.get("rewards") or []
    if rewards:
        trs = "".join(f'<tr><td>{escape(str(r.get("name")))}</td>'
                      f'<td class="num">{fmt_value(r.get("weight"))}</td></tr>'
                      for r in rewards if isinstance(r, dict))
        parts.append(f"<h3>Rewards</h3><table><tr><th>reward</th><th>weight</th></tr>{trs}</table>")
    rms = ev.get("reward_models") or {}
    if isinstance(rms, dict) and rms:
        trs = "".join(f'<tr><td>{escape(str(k))}</td><td class="num">{fmt_value(v)}</td></tr>'
                      for k, v in rms.items())
        parts.append("<h3>Reward models (held-out pair accuracy)</h3>"
                     f"<table><tr><th>reward model</th><th>accuracy</th></tr>{trs}</table>")
    return "".join(parts)


def render_warnings(path: Path, rows: list[dict[str, Any]]) -> str:
    """Degraded behaviour of the run (warnings.jsonl: reward errors replaced, skipped optimizer
    steps): totals, then each message with the steps it came at; '' when there was none."""
    messages: dict[str, list[int]] = {}
    lines = path.read_text(encoding="utf-8").splitlines() if path.exists() else []
    for line in lines:
        try:
            entry = json.loads(line)
            messages.setdefault(str(entry["message"]), []).append(int(entry["step"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by a kill: the metrics still count it
    totals = {key: sum(r.get(key) or 0 for r in rows) for key in ("reward_errors", "skipped_steps")}
    if not messages and not any(totals.values()):
        return ""
    head = ", ".join(f"{k}: {v}" for k, v in totals.items())
    trs = "".join(f'<tr><td class="num">{len(steps)}</td><td>{escape(", ".join(map(str, steps[:20])))}'
                  f'{" …" if len(steps) > 20 else ""}</td><td>{escape(m)}</td></tr>'
                  for m, steps in sorted(messages.items(), key=lambda kv: -len(kv[1]))[:50])
    return (f'<h2 id="warnings">Warnings</h2><p class="flag">{escape(head)}</p>'
            f"<table><tr><th>times</th><th>steps</th><th>message</th></tr>{trs}</table>")


def load_rows(run_dir: Path) -> list[dict[str, Any]]:
    """The run's metrics rows, deduped by step; [] when metrics.jsonl is absent."""
    path = run_dir / METRICS_FILE
    return dedupe_by_step(read_metrics(path)) if path.exists() else []


def write_atomic(path: Path, text: str) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text, encoding="utf-8")
    os.replace(tmp, path)
    return path


def write_report(run_dir: str | Path, out_path: str | Path | None = None) -> Path:
    """Writes run_dir/report.html (or out_path) from the run directory's files; returns its path."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise FileNotFoundError(f"report: run directory {run_dir} does not exist")
    # Inputs are read and validated before the (slower) plotting, so a bad file fails fast.
    inspector_html = render_inspector(run_dir / "samples.jsonl")
    eval_html = render_eval(run_dir / "eval.json")
    rows = load_rows(run_dir)
    name = run_dir.resolve().name
    body = [f"<h1>grpolab run: {escape(name)}</h1>"]
    if rows:
        body += ["<h2>Summary</h2>", render_summary(rows), render_warnings(run_dir / "warnings.jsonl", rows),
                 "<h2>Training curves</h2>", render_plots(rows)]
    else:
        body.append(f'<p class="note">No training curves: {METRICS_FILE} is missing or empty.</p>')
    body += ["<h2>Evaluation before / after</h2>", eval_html]
    cfg = run_dir / "config.yaml"
    if cfg.exists():
        body.append("<h2>Config</h2><details><summary>config.yaml</summary>"
                    f"<pre>{escape(cfg.read_text(encoding='utf-8'))}</pre></details>")
    body += ['<h2 id="inspector">Rollout inspector</h2>',
             inspector_html]
    out = Path(out_path) if out_path is not None else run_dir / REPORT_FILE
    return write_atomic(out, render_page(f"grpolab report: {name}", "".join(body)))
