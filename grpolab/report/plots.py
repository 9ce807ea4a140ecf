"""Metric curves as matplotlib figures (Agg, no pyplot state) returned as base64 PNG strings.

Shared by the run report (html.py) and the run comparison (compare.py). Series are read from
metrics rows by key; `null` values and missing keys become gaps; a step logged twice (a resumed
run re-logging steps after its last checkpoint) keeps its last row.
"""

from __future__ import annotations

import base64
import io
import math
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

FIGSIZE = (5.4, 3.1)  # inches; at DPI 100 a 540x310 px image
DPI = 100


@dataclass(frozen=True)
class Series:
    key: str
    label: str
    std_key: str | None = None  # if set: a shaded band mean ± std


@dataclass(frozen=True)
class PlotSpec:
    title: str
    series: tuple[Series, ...]
    ylabel: str = ""
    stacked: bool = False  # stack the series (e.g. phase times adding up to a step)
    total_key: str | None = None  # drawn as a line over a stacked plot


def dedupe_by_step(rows: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows sorted by step, keeping the last row logged for each step."""
    by_step: dict[int, dict[str, Any]] = {}
    for row in rows:
        by_step[row["step"]] = row
    return [by_step[s] for s in sorted(by_step)]


def series_values(rows: Sequence[dict[str, Any]], key: str) -> tuple[np.ndarray, np.ndarray]:
    """(steps [T], values [T]) for rows (already deduped); missing/null/non-numeric -> NaN."""
    steps = np.array([r["step"] for r in rows], dtype=float)
    vals = np.array([_num(r.get(key)) for r in rows], dtype=float)
    return steps, vals


def has_data(rows: Sequence[dict[str, Any]], key: str) -> bool:
    return any(math.isfinite(_num(r.get(key))) for r in rows)


def _num(v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return math.nan
    return float(v)


def smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Centered moving average over the finite values in each window; NaN where none. [T]->[T]"""
    finite = np.isfinite(values)
    filled = np.where(finite, values, 0.0)
    kernel = np.ones(window)
    total = np.convolve(filled, kernel, mode="same")
    count = np.convolve(finite.astype(float), kernel, mode="same")
    with np.errstate(invalid="ignore", divide="ignore"):
        return np.where(count > 0, total / np.maximum(count, 1), np.nan)


def _new_axes(title: str, ylabel: str):
    fig = Figure(figsize=FIGSIZE, dpi=DPI)
    # Fixed margins: constrained layout would draw every figure twice.
    fig.subplots_adjust(left=0.13, right=0.98, top=0.9, bottom=0.15)
    ax = fig.add_subplot()
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("step", fontsize=8)
    if ylabel:
        ax.set_ylabel(ylabel, fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(True, alpha=0.3)
    return fig, ax


def _draw_line(ax, steps: np.ndarray, vals: np.ndarray, label: str, color,
               std: np.ndarray | None = None) -> None:
    """One curve; over 30 points: the raw values faint and a moving average; optional ±std band
    (around the moving average, with the std averaged the same way)."""
    n = int(np.isfinite(vals).sum())
    if n > 30:
        window = max(3, n // 25)
        ax.plot(steps, vals, color=color, alpha=0.25, linewidth=0.8)
        vals = smooth(vals, window)
        std = smooth(std, window) if std is not None else None
        ax.plot(steps, vals, color=color, label=label, linewidth=1.4)
    else:
        ax.plot(steps, vals, color=color, label=label, marker="o", markersize=3, linewidth=1.2)
    if std is not None and np.isfinite(std).any():
        ax.fill_between(steps, vals - std, vals + std, color=color, alpha=0.15, linewidth=0)


def to_png_base64(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=DPI)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def render_plot(rows: Sequence[dict[str, Any]], spec: PlotSpec) -> str | None:
    """Base64 PNG of one plot of a single run, or None when none of its keys has data."""
    present = [s for s in spec.series if has_data(rows, s.key)]
    if not present:
        return None
    fig, ax = _new_axes(spec.title, spec.ylabel)
    colors = [f"C{i}" for i in range(10)]
    if spec.stacked:
        steps = series_values(rows, present[0].key)[0]
        ys = [np.nan_to_num(series_values(rows, s.key)[1]) for s in present]
        ax.stackplot(steps, *ys, labels=[s.label for s in present], colors=colors[:len(ys)],
                     alpha=0.7)
        if spec.total_key and has_data(rows, spec.total_key):
            ax.plot(*series_values(rows, spec.total_key), color="black", linewidth=1,
                    label="total")
    else:
        for i, s in enumerate(present):
            steps, vals = series_values(rows, s.key)
            std = series_values(rows, s.std_key)[1] if s.std_key else None
            _draw_line(ax, steps, vals, s.label, colors[i % 10], std)
    if len(present) > 1 or spec.stacked or present[0].std_key:
        ax.legend(fontsize=7, loc="best")
    return to_png_base64(fig)


def render_overlay(runs: Sequence[tuple[str, Sequence[dict[str, Any]]]], key: str, title: str,
                   ylabel: str = "") -> str | None:
    """Base64 PNG overlaying one metric of several runs (label, deduped rows); None if no data."""
    present = [(label, rows) for label, rows in runs if has_data(rows, key)]
    if not present:
        return None
    fig, ax = _new_axes(title, ylabel)
    for i, (label, rows) in enumerate(present):
        _draw_line(ax, *series_values(rows, key), label, f"C{i % 10}")
    ax.legend(fontsize=7, loc="best")
    return to_png_base64(fig)
