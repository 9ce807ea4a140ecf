"""The rollout inspector of report.html: chosen steps' prompt groups from samples.jsonl.

For each chosen step (first, a few in the middle, last) every prompt group is a table of its G
completions with per-reward scores, combined reward, advantage, length and truncation; the
tables sort when a column header is clicked (the script lives in html.py). A completion that
holds a multi-turn agent episode shows the episode's segments in order instead of its text: policy
segments (the sampled, trained tokens) highlighted, prompt and environment segments marked as
context that is not trained, under a line of turns, tool calls, tool errors and stop reason. All
model text is HTML-escaped.
"""

from __future__ import annotations

import json
import math
from html import escape
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from grpolab.report.metrics import iter_jsonl
from grpolab.report.schema import validate_sample_row

MAX_STEPS = 5  # steps offered in the <select>
MAX_GROUPS = 16  # prompt groups shown per step
MAX_CHARS = 4000  # characters of a completion or prompt shown


def choose_steps(steps: Sequence[int], n: int = MAX_STEPS) -> list[int]:
    """First, last and evenly spaced middle steps of the sorted unique `steps`, at most n."""
    uniq = sorted(set(steps))
    if len(uniq) <= n:
        return uniq
    idx = np.unique(np.round(np.linspace(0, len(uniq) - 1, n)).astype(int))
    return [uniq[i] for i in idx]


def load_samples(path: str | Path, steps: Sequence[int] | None = None
                 ) -> tuple[dict[int, list[dict[str, Any]]], list[int]]:
    """({step: [group rows]} for the chosen steps, all steps present in the file).

    steps: the steps to keep; None = choose_steps(all steps). Each kept row is validated;
    a bad row raises ValueError with file:line.
    """
    path = Path(path)
    all_steps = []
    for lineno, row in iter_jsonl(path):
        step = row.get("step")
        if isinstance(step, bool) or not isinstance(step, int):
            raise ValueError(f"{path}:{lineno}: 'step' must be an integer, got {step!r}")
        all_steps.append(step)
    keep = set(choose_steps(all_steps) if steps is None else steps)
    groups: dict[int, list[dict[str, Any]]] = {s: [] for s in sorted(keep & set(all_steps))}
    for lineno, row in iter_jsonl(path):
        if row["step"] in keep:
            try:
                validate_sample_row(row)
            except ValueError as e:
                raise ValueError(f"{path}:{lineno}: {e}") from None
            groups[row["step"]].append(row)
    return groups, sorted(set(all_steps))


def _clip_text(text: str) -> str:
    if len(text) <= MAX_CHARS:
        return escape(text)
    return (escape(text[:MAX_CHARS])
            + f'<span class="note">[… {len(text) - MAX_CHARS} more characters not shown]</span>')


def _fmt(v: Any) -> tuple[str, str]:
    """(data-v sort value, shown text) of a number cell; '' sort value for null."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return "", "–"
    return repr(float(v)), f"{v:.4g}" if isinstance(v, float) else str(v)


def _shade(v: Any, scale: float) -> str:
    """An inline background: green for positive, red for negative, by |v| / scale."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or scale <= 0:
        return ""
    a = min(abs(v) / scale, 1.0) * 0.45
    rgb = "40,160,60" if v > 0 else "210,50,50"
    return f' style="background: rgba({rgb},{a:.2f})"'


def _num_cell(v: Any, scale: float = 0.0) -> str:
    sort, text = _fmt(v)
    return f'<td class="num" data-v="{sort}"{_shade(v, scale)}>{text}</td>'


def _tokens(n: int) -> str:
    return f"{n} token{'' if n == 1 else 's'}"


def _episode_stats(ep: dict[str, Any]) -> str:
    """The episode's one-line summary: turns, tool calls, tool errors, stop reason, env reward."""
    stop = escape(ep["stop_reason"])
    if ep["stop_reason"] != "done":
        stop = f'<span class="flag">{stop}</span>'
    errors = f'<span class="flag">{ep["tool_errors"]}</span>' if ep["tool_errors"] else "0"
    line = (f'turns {ep["turns"]} · tool calls {ep["tool_calls"]} · tool errors {errors}'
            f" · stop reason {stop}")
    if ep.get("env_reward") is not None:
        line += f" · env reward {_fmt(ep['env_reward'])[1]}"
    return f'<div class="ep-stats">{line}</div>'


def render_episode(ep: dict[str, Any]) -> str:
    """A completion's agent episode: its stats line, then every segment in order. Policy segments
    (trained) are highlighted and numbered by turn; environment segments are labelled as context;
    prompt segments (the opening messages, as in the group's prompt) are collapsed."""
    parts = [_episode_stats(ep)]
    turn = 0
    for seg in ep["segments"]:
        source, text = seg["source"], _clip_text(seg["text"])
        if source == "policy":
            turn += 1
            parts.append(f'<div class="seg seg-policy" data-source="policy"><span class="seg-label">'
                         f"policy · turn {turn} · {_tokens(seg['tokens'])} (trained)</span>"
                         f"<pre>{text}</pre></div>")
        elif source == "env":
            parts.append(f'<div class="seg seg-env" data-source="env"><span class="seg-label">'
                         f"environment · {_tokens(seg['tokens'])} (context, not trained)</span>"
                         f"<pre>{text}</pre></div>")
        else:
            parts.append(f'<details class="seg seg-prompt" data-source="prompt"><summary class="seg-label">'
                         f"prompt · {_tokens(seg['tokens'])} (context, not trained)</summary>"
                         f"<pre>{text}</pre></details>")
    return f'<div class="episode">{"".join(parts)}</div>'


def _completion_cell(c: dict[str, Any]) -> str:
    """The completion column: the episode when the completion has one, else its text."""
    if "episode" in c:
        return f"<td>{render_episode(c['episode'])}</td>"
    return f'<td><pre class="comp">{_clip_text(c["text"])}</pre></td>'


def _reward_names(group: dict[str, Any]) -> list[str]:
    names: list[str] = []
    for c in group["completions"]:
        for name in c.get("rewards", {}):
            if name not in names:
                names.append(name)
    return names


def render_group(group: dict[str, Any], gi: int) -> str:
    """One prompt group: the prompt, its metadata, and a sortable table of its completions."""
    comps = group["completions"]
    names = _reward_names(group)
    rewards = [c.get("reward") for c in comps]
    finite = [r for r in rewards if isinstance(r, (int, float)) and math.isfinite(r)]
    advs = [abs(c["advantage"]) for c in comps if isinstance(c.get("advantage"), (int, float))
            and math.isfinite(c["advantage"])]
    adv_scale = max(advs, default=0.0)
    summary = f"G = {len(comps)}"
    if finite:
        summary += f", reward mean {np.mean(finite):.4g}, std {np.std(finite):.4g}"
        if len(set(finite)) == 1 and len(finite) > 1:
            summary += ' <span class="flag">all rewards equal: zero advantage</span>'
    meta = group.get("meta") or {}
    meta_html = (f'<div class="meta">meta: <code>{escape(json.dumps(meta, ensure_ascii=False))}'
                 f"</code></div>" if meta else "")
    head = ("<tr><th>#</th><th>completion</th>"
            + "".join(f"<th>{escape(n)}</th>" for n in names)
            + "<th>reward</th><th>advantage</th><th>length</th><th>truncated</th></tr>")
    body = []
    for i, c in enumerate(comps):
        cells = [f'<td class="num" data-v="{i}">{i}</td>', _completion_cell(c)]
        cells += [_num_cell(c.get("rewards", {}).get(n)) for n in names]
        cells += [_num_cell(c.get("reward")), _num_cell(c.get("advantage"), adv_scale),
                  _num_cell(c.get("length"))]
        trunc = c.get("truncated")
        cells.append(f'<td data-v="{int(bool(trunc))}">{"yes" if trunc else "no"}</td>')
        body.append("<tr>" + "".join(cells) + "</tr>")
    return (f'<div class="group"><h4>group {gi}: {summary}</h4>'
            f'<pre class="prompt">{_clip_text(group["prompt"])}</pre>{meta_html}'
            f'<table class="sortable inspector"><thead>{head}</thead>'
            f'<tbody>{"".join(body)}</tbody></table></div>')


def render_inspector(samples_path: str | Path) -> str:
    """The inspector section's HTML: a step <select> and one panel per chosen step."""
    path = Path(samples_path)
    if not path.exists():
        return f'<p class="note">No rollout samples: {escape(path.name)} was not written.</p>'
    groups, all_steps = load_samples(path)
    if not groups:
        return f'<p class="note">{escape(path.name)} holds no prompt groups.</p>'
    chosen = list(groups)
    options = "".join(f'<option value="{s}"{" selected" if i == 0 else ""}>step {s}</option>'
                      for i, s in enumerate(chosen))
    panels = []
    for i, step in enumerate(chosen):
        rows = groups[step]
        note = (f'<p class="note">showing {MAX_GROUPS} of {len(rows)} prompt groups</p>'
                if len(rows) > MAX_GROUPS else "")
        inner = "".join(render_group(g, gi) for gi, g in enumerate(rows[:MAX_GROUPS]))
        hidden = "" if i == 0 else " hidden"
        panels.append(f'<div class="step-panel" data-step="{step}"{hidden}>{note}{inner}</div>')
    return (f'<p>Samples were logged for {len(all_steps)} steps; {len(chosen)} are shown. '
            f'Click a column header to sort.</p>'
            f'<label>step: <select id="step-select">{options}</select></label>'
            + "".join(panels))
