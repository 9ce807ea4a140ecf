"""The ablation's table, computed summary and page (ablate.html), from its runs' eval.json payloads.

Statistics: each metric's mean and sample sd over seeds. A change between two variants (difference
of their means, Δ) counts as beyond the seed spread when |Δ| ≥ SPREAD × the pooled sd,
sqrt((sd_a² + sd_b²) / 2); with one seed there is no spread to compare with. Curves show the mean
over seeds with a band from the lowest to the highest seed.
"""

from __future__ import annotations

import math
import warnings
from html import escape
from pathlib import Path
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure

from grpolab.report.html import render_page, write_atomic
from grpolab.report.metrics import read_metrics
from grpolab.report.plots import DPI, FIGSIZE, dedupe_by_step, smooth, to_png_base64

METRICS = ("accuracy", "refusal_recall", "false_refusal")
SPREAD = 2.0
"""|Δ| ≥ SPREAD pooled seed sds: a change beyond the seed spread."""
DIAL_VARIANTS = ("onpolicy_sft", "reinforce", "reinforce_norm", "grpo_no_is", "grpo_no_kl", "grpo")


def dial(variants: Sequence[str]) -> list[tuple[str, str, str, bool | None]]:
    """The steps from on-policy SFT to GRPO among `variants`: (what the step adds, from, to, whether
    the SFT-to-GRPO spectrum expects it to matter: True for its tricks 1-2, False for 3-4, None for no trick of its).
    With grpo_no_is (GRPO's several updates per rollout without the ratio) the third step splits
    into the extra updates and the importance ratio with its clipping."""
    steps: list[tuple[str, str, str, bool | None]] = [
        ("negative gradient", "onpolicy_sft", "reinforce", True),
        ("reward normalization", "reinforce", "reinforce_norm", True)]
    if "grpo_no_is" in variants:
        steps += [("several updates per rollout, uncorrected", "reinforce_norm", "grpo_no_is", None),
                  ("importance sampling + clipping", "grpo_no_is", "grpo_no_kl", False)]
    else:
        steps.append(("importance sampling + clipping, with several updates per rollout", "reinforce_norm",
                      "grpo_no_kl", False))
    return steps + [("KL penalty", "grpo_no_kl", "grpo", False)]


def stat(values: Sequence[float]) -> dict[str, Any]:
    """mean, sample sd (NaN for one value), min, max, n and the values."""
    v = [float(x) for x in values]
    mean = sum(v) / len(v) if v else math.nan
    sd = math.sqrt(sum((x - mean) ** 2 for x in v) / (len(v) - 1)) if len(v) > 1 else math.nan
    return {"mean": mean, "sd": sd, "min": min(v, default=math.nan), "max": max(v, default=math.nan),
            "n": len(v), "values": v}


def _row(variant: str, payloads: list[dict]) -> dict[str, Any]:
    row = {"variant": variant, "seeds": [p["seed"] for p in payloads]}
    for m in METRICS:
        row[m] = stat([p["after"][m] for p in payloads])
    row["gain"] = stat([p["after"]["accuracy"] - p["before"]["accuracy"] for p in payloads])
    for k in ("wall_s", "completions", "tokens", "steps"):
        row[k] = stat([p[k] for p in payloads])
    row["optimizer_steps_per_step"] = payloads[0]["optimizer_steps_per_step"] if payloads else None
    return row


def ablation_table(variants: Sequence[str], pi0: dict[int, dict], runs: dict[str, dict]) -> list[dict]:
    """One row per variant with runs (in `variants` order), after a first row for π0."""
    by_seed = [pi0[s] for s in sorted(pi0)]
    first = {"variant": "pi0", "seeds": sorted(pi0), "wall_s": stat([p["wall_s"] for p in by_seed]),
             **{m: stat([p["pi0"][m] for p in by_seed]) for m in METRICS}}
    rows = [first]
    for v in variants:
        payloads = sorted((p for p in runs.values() if p["variant"] == v), key=lambda p: p["seed"])
        if payloads:
            rows.append(_row(v, payloads))
    return rows


def compare(a: dict, b: dict, metric: str = "accuracy") -> dict[str, Any]:
    """Row b against row a: Δ of the means, the pooled sd, |Δ| in pooled sds and the verdict
    ("beyond" / "within" the seed spread, or "n/a" with fewer than two seeds on a side)."""
    sa, sb = a[metric], b[metric]
    delta = sb["mean"] - sa["mean"]
    if min(sa["n"], sb["n"]) < 2:
        return {"delta": delta, "pooled_sd": math.nan, "ratio": math.nan, "verdict": "n/a"}
    pooled = math.sqrt((sa["sd"] ** 2 + sb["sd"] ** 2) / 2)
    ratio = abs(delta) / pooled if pooled > 0 else (math.inf if delta else 0.0)
    return {"delta": delta, "pooled_sd": pooled, "ratio": ratio, "verdict": "beyond" if ratio >= SPREAD else "within"}


def _change(c: dict) -> str:
    delta = f"{round(c['delta'], 3) + 0.0:+.3f}"  # + 0.0: no "-0.000"
    if c["verdict"] == "n/a":
        return f"{delta} (one seed: no spread to compare with)"
    return f"{delta} ({c['ratio']:.1f} pooled sd: {c['verdict']} the seed spread)"


def _trick_verdict(c: dict, matters: bool) -> tuple[str, bool]:
    """What a dial step did, and whether that agrees with the spectrum's claim (matters: it should help beyond
    the spread; else: adding it should not help beyond the spread, so it can be dropped)."""
    helps = c["verdict"] == "beyond" and c["delta"] > 0
    hurts = c["verdict"] == "beyond" and c["delta"] < 0
    did = "helps" if helps else "hurts" if hurts else "no change beyond the seed spread"
    return did, helps if matters else not helps


def summary_lines(rows: Sequence[dict]) -> list[str]:
    """The computed summary: each dial step, the spectrum's claim against it, the other variants against
    grpo, and the best variant."""
    by = {r["variant"]: r for r in rows}
    n = max((r["accuracy"]["n"] for r in rows[1:]), default=0)
    out = [f"Held-out greedy accuracy, mean over {n} seed(s); a change is beyond the seed spread when "
           f"|Δ| ≥ {SPREAD:g} pooled sd (sqrt of the mean of the two variants' variances over seeds)."]
    verdicts = []
    for trick, a, b, matters in dial(list(by)):
        if a not in by or b not in by:
            continue
        acc, rec = compare(by[a], by[b]), compare(by[a], by[b], "refusal_recall")
        out.append(f"- {trick} ({a} → {b}): accuracy {_change(acc)}; refusal recall {_change(rec)}.")
        if acc["verdict"] != "n/a" and matters is not None:
            did, agrees = _trick_verdict(acc, matters)
            verdicts.append(f"{trick} {did} ({'agrees' if agrees else 'disagrees'})")
    if verdicts:
        agree = sum(v.endswith("(agrees)") for v in verdicts)
        out.append("The SFT-to-GRPO spectrum: the negative gradient and reward normalization matter most; importance sampling "
                   "and the KL penalty can be varied or dropped (clipping, its trick 2, needs the importance "
                   f"ratio here). Measured: {'; '.join(verdicts)}: {agree} of {len(verdicts)} agree.")
    others = [r["variant"] for r in rows[1:] if r["variant"] not in DIAL_VARIANTS]
    for name in others:  # sft_o1 (more on-policy steps instead of the negative gradient) vs reinforce
        base = "reinforce" if name == "sft_o1" else "grpo"
        if base in by:
            out.append(f"- {name} vs {base}: accuracy {_change(compare(by[base], by[name]))}.")
    if len(rows) > 1:
        sds = sorted(r["accuracy"]["sd"] for r in rows[1:] if r["accuracy"]["n"] > 1)
        gains = [r["gain"]["mean"] for r in rows[1:]]
        if sds:
            out.append(f"Seed spread: the sd of a variant's held-out accuracy over seeds is {sds[0]:.3f} to {sds[-1]:.3f} "
                       f"(median {sds[len(sds) // 2]:.3f}); mean gains over π0 range from {min(gains):+.3f} to "
                       f"{max(gains):+.3f}.")
        best = max(rows[1:], key=lambda r: r["accuracy"]["mean"])
        out.append(f"Highest held-out accuracy: {best['variant']} {_pm(best['accuracy'])} "
                   f"(π0 {_pm(rows[0]['accuracy'])}).")
    return out


def jsonable(obj: Any) -> Any:
    """`obj` with non-finite floats (the sd of one seed) as None, for strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [jsonable(v) for v in obj]
    return obj


def ablation_data(settings: dict, pi0: dict[int, dict], runs: dict[str, dict], wall_s: float) -> dict:
    """ablate.json: the settings, π0 per seed, every run's payload, the table and the summary."""
    rows = ablation_table(settings["variants"], pi0, runs)
    return {"settings": settings, "pi0": {str(s): p for s, p in sorted(pi0.items())},
            "runs": dict(sorted(runs.items())), "table": rows, "summary": summary_lines(rows), "wall_s": wall_s}


# ----------------------------------------------------------------------------- text and HTML


def _pm(s: dict, digits: int = 3) -> str:
    if not s["n"]:
        return "–"
    sd = "" if math.isnan(s["sd"]) else f" ± {s['sd']:.{digits}f}"
    return f"{s['mean']:.{digits}f}{sd}"


def _count(s: dict) -> str:
    lo, hi = int(round(s["min"])), int(round(s["max"]))
    return f"{lo}" if lo == hi else f"{lo}-{hi}"


COLUMNS = ("variant", "seeds", "held-out accuracy", "gain vs π0", "refusal recall", "false refusal", "wall s",
           "completions", "gen. tokens")


def table_cells(row: dict) -> list[str]:
    """The text cells of one table row (mean ± sd over seeds; π0's wall time is its build)."""
    pi0 = row["variant"] == "pi0"
    return [row["variant"], str(len(row["seeds"])), _pm(row["accuracy"]), "" if pi0 else _pm(row["gain"], 3),
            _pm(row["refusal_recall"]), _pm(row["false_refusal"]), _pm(row["wall_s"], 0),
            "0" if pi0 else _count(row["completions"]), "0" if pi0 else f"{row['tokens']['mean'] / 1000:.1f}k"]


def format_table(data: dict) -> str:
    """The table as aligned text (stdout)."""
    cells = [list(COLUMNS)] + [table_cells(r) for r in data["table"]]
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    return "\n".join("  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
                     for row in cells)


def _html_table(rows: Sequence[dict]) -> str:
    head = "".join(f"<th>{escape(c)}</th>" for c in COLUMNS)
    keys = (None, None, "accuracy", "gain", "refusal_recall", "false_refusal", "wall_s", "completions", "tokens")
    trs = []
    for r in rows:
        tds = []
        for k, text in zip(keys, table_cells(r)):
            v = r.get(k, {}).get("mean") if k else None
            attr = f' data-v="{v:.6g}"' if isinstance(v, float) and math.isfinite(v) else ""
            tds.append(f'<td class="num"{attr}>{escape(text)}</td>' if k else f"<td>{escape(text)}</td>")
        trs.append("<tr>" + "".join(tds) + "</tr>")
    return f'<table class="sortable" id="ablate-table"><thead><tr>{head}</tr></thead><tbody>{"".join(trs)}</tbody></table>'


def _band(series: list[tuple[np.ndarray, np.ndarray]]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Seeds' (x, y) series on the union of their x up to where the shortest ends (DAPO's runs end
    at different counts past the budget), each seed interpolated: (x, mean, min, max)."""
    grid = np.unique(np.concatenate([x for x, _ in series]))
    grid = grid[grid <= min(x[-1] for x, _ in series)]
    ys = np.stack([np.interp(grid, x, y, left=np.nan, right=np.nan) for x, y in series])
    with warnings.catch_warnings():  # a column no seed covers stays NaN (a gap)
        warnings.simplefilter("ignore", RuntimeWarning)
        return grid, np.nanmean(ys, 0), np.nanmin(ys, 0), np.nanmax(ys, 0)


def _plot(curves: dict[str, list[tuple[np.ndarray, np.ndarray]]], title: str, ylabel: str,
          colors: dict[str, str]) -> str | None:
    """Base64 PNG: per variant the mean over seeds and a min-max band, against generated completions."""
    curves = {v: s for v, s in curves.items() if s}
    if not curves:
        return None
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    fig.subplots_adjust(left=0.13, right=0.98, top=0.9, bottom=0.15)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("generated completions", fontsize=8)
    ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.grid(True, alpha=0.3)
    for v, series in curves.items():
        x, mean, lo, hi = _band(series)
        ax.plot(x, mean, color=colors[v], label=v, linewidth=1.3, marker="o" if len(x) <= 12 else None,
                markersize=3)
        ax.fill_between(x, lo, hi, color=colors[v], alpha=0.15, linewidth=0)
    ax.legend(fontsize=7, loc="best")
    return to_png_base64(fig)


def heldout_curves(data: dict, metric: str) -> dict[str, list]:
    """variant -> [(completions [K], metric [K])] per seed, from the runs' held-out evaluations."""
    out: dict[str, list] = {v: [] for v in data["settings"]["variants"]}
    for p in data["runs"].values():
        pts = p["curve"]
        out[p["variant"]].append((np.array([c["completions"] for c in pts], float),
                                  np.array([c[metric] for c in pts], float)))
    return out


def training_curves(out_dir: Path, data: dict, key: str = "accuracy") -> dict[str, list]:
    """variant -> [(completions [T], smoothed `key` [T])] per seed, from the runs' metrics.jsonl."""
    s = data["settings"]
    curves: dict[str, list] = {v: [] for v in s["variants"]}
    for name, p in data["runs"].items():
        path = out_dir / name / "metrics.jsonl"
        if not path.is_file():
            continue
        rows = dedupe_by_step(read_metrics(path))
        n = s["prompts_per_step"] * s["group_size"]
        x = np.cumsum([n * int(r.get("rollout/gen_batches") or 1) for r in rows]).astype(float)
        y = np.array([r.get(key) if isinstance(r.get(key), (int, float)) else np.nan for r in rows], float)
        if np.isfinite(y).any():
            curves[p["variant"]].append((x, smooth(y, max(1, len(y) // 10))))
    return curves


def _figures(out_dir: Path, data: dict) -> str:
    variants = data["settings"]["variants"]
    colors = {v: f"C{i % 10}" for i, v in enumerate(variants)}  # a variant keeps its color in every plot
    groups = {"the dial": [v for v in DIAL_VARIANTS if v in variants],
              "grpo and the others": [v for v in variants if v == "grpo" or v not in DIAL_VARIANTS]}
    figs = []
    for title, curves in (("held-out accuracy", heldout_curves(data, "accuracy")),
                          ("held-out refusal recall", heldout_curves(data, "refusal_recall")),
                          ("training accuracy (smoothed)", training_curves(out_dir, data))):
        for group, names in groups.items():
            img = _plot({v: curves.get(v, []) for v in names}, f"{title}: {group}", title.split(" (")[0], colors)
            if img:
                figs.append(f'<figure><img alt="{escape(title)}" src="data:image/png;base64,{img}">'
                            f"<figcaption>{escape(title)}, {escape(group)}: mean over seeds, band from the lowest "
                            "to the highest seed</figcaption></figure>")
    return f'<div class="grid">{"".join(figs)}</div>'


def write_html(out_dir: Path, data: dict) -> Path:
    """OUT/ablate.html: settings, summary, table, curves, run directories."""
    s = data["settings"]
    facts = (f"{len(s['variants'])} variants × seeds {', '.join(map(str, s['seeds']))}; every run generates "
             f"{s['budget_completions']} completions ({s['prompts_per_step']} prompts × {s['group_size']} × "
             f"{s['steps']} steps); max_new_tokens {s['max_new_tokens']}; lr {s['lr']:g} ({s['lr_schedule']}); "
             f"rewards {', '.join(s['rewards'])}; {s['eval_prompts']} held-out prompts; overrides: "
             f"{' '.join(s['overrides']) or 'none'}; {s['jobs']} job(s); wall time {data['wall_s']:.0f} s "
             f"({len(data['runs']) - data.get('reused_runs', 0)} run(s) trained by this invocation)")
    body = ["<h1>grpolab ablation</h1>", f"<p>{escape(facts)}</p>", "<h2>Summary</h2>",
            "<ul>" + "".join(f"<li>{escape(line.removeprefix('- '))}</li>" for line in data["summary"]) + "</ul>",
            "<h2>Final table</h2>", _html_table(data["table"]),
            '<p class="note">mean ± sd over seeds; gain = final − π0 held-out accuracy per seed; wall s: training and '
            "evaluations of a run (π0: its build); gen. tokens: completions' tokens, EOS included.</p>"]
    if data.get("failed"):
        body.append('<p class="flag">Failed: ' + escape("; ".join(data["failed"])) + "</p>")
    body += ["<h2>Curves</h2>", _figures(out_dir, data), "<h2>Run directories</h2>",
             "<p>" + ", ".join(f'<a href="{escape(n)}/">{escape(n)}</a>' for n in data["runs"]) + "</p>"]
    return write_atomic(Path(out_dir) / "ablate.html", render_page("grpolab ablation", "".join(body)))
