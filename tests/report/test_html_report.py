import base64
import json
from html.parser import HTMLParser

import pytest

from grpolab.report import inspector
from grpolab.report.html import write_report
from grpolab.report.inspector import choose_steps
from grpolab.report.plots import dedupe_by_step

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


class Elements(HTMLParser):
    """Collects (tag, attrs) of every start tag, and the text inside <script>."""

    def __init__(self, text: str):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[str] = []
        self._in_script = False
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        self._in_script = tag == "script"

    def handle_endtag(self, tag):
        self._in_script = False

    def handle_data(self, data):
        if self._in_script:
            self.scripts.append(data)

    def find(self, tag, **attrs):
        return [a for t, a in self.tags if t == tag
                and all(a.get(k.rstrip("_")) == v for k, v in attrs.items())]


def parse(path):
    return Elements(path.read_text(encoding="utf-8"))


def test_report_has_plots_eval_table_and_inspector(fake_report):
    out = fake_report
    assert out.name == "report.html" and (out.parent / "metrics.jsonl").exists()
    text = out.read_text(encoding="utf-8")
    page = parse(out)
    imgs = [a["src"] for t, a in page.tags if t == "img"]
    # combined + 2 per-reward + accuracy, 8 policy plots, 2 rollout plots, 3 speed plots
    assert len(imgs) == 17
    for src in imgs:
        assert src.startswith("data:image/png;base64,")
        assert base64.b64decode(src.split(",", 1)[1])[:8] == PNG_MAGIC
    # Self-contained: nothing fetched from elsewhere.
    external = [a for _, a in page.tags
                if a.get("href") or not (a.get("src") or "data:").startswith("data:")]
    assert external == []
    assert "Not logged in this run" not in text
    # Eval table: before, after, change.
    assert "<th>accuracy</th><td class=\"num\">0.25</td><td class=\"num\">0.5</td>" \
           "<td class=\"num\">+0.25</td>" in text
    assert "refusal_rm" in text and "0.87" in text
    # Inspector: a <select> of the logged steps, 2 steps x 2 groups of 4 completions.
    assert [a["value"] for a in page.find("option")] == ["0", "4"]
    assert len(page.find("div", class_="step-panel")) == 2
    assert len(page.find("table", class_="sortable inspector")) == 4
    assert text.count('<pre class="comp">') == 16
    assert "<th>advantage</th>" in text and "<th>accuracy_rm</th>" in text


def test_model_text_is_escaped(fake_report):
    page_text = fake_report.read_text(encoding="utf-8")
    assert "<b>answer</b>" not in page_text
    assert "&lt;b&gt;answer&lt;/b&gt; 0-0-0 &amp; &#x27;quote&#x27;" in page_text
    # The prompts contain '<script>': the only script element is the report's own.
    assert len(parse(fake_report).scripts) == 1


def test_missing_optional_files_degrade_to_notes(run_factory):
    run = run_factory(samples=False, eval_json=False)
    (run / "config.yaml").unlink()
    text = write_report(run).read_text(encoding="utf-8")
    assert "samples.jsonl was not written" in text
    assert "eval.json was not written" in text
    assert "Config" not in text
    assert text.count("data:image/png;base64,") == 17

    (run / "metrics.jsonl").unlink()
    text = write_report(run).read_text(encoding="utf-8")
    assert "metrics.jsonl is missing or empty" in text
    assert "data:image/png" not in text


def test_unlogged_metrics_noted_and_extra_metrics_plotted(run_factory):
    run = run_factory()
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    with (run / "metrics.jsonl").open("w") as f:
        for r in rows:
            del r["accuracy"], r["mfu"]
            r["kl"] = None  # a null everywhere is the same as not logged
            r["entropy"] = None if r["step"] == 2 else r["entropy"]  # a gap is fine
            r["my/new_metric"] = r["step"] ** 2
            f.write(json.dumps(r) + "\n")
    text = write_report(run).read_text(encoding="utf-8")
    assert ("Not logged in this run (no plot): accuracy (verifiable rows), KL to reference, "
            "model FLOP utilisation.") in text
    assert "Other logged metrics" in text and 'alt="my/new_metric"' in text
    assert text.count("data:image/png;base64,") == 17 - 3 + 1


def test_bad_samples_line_names_file_and_line(run_factory):
    run = run_factory()
    lines = (run / "samples.jsonl").read_text().splitlines()
    bad = json.loads(lines[1])
    bad["completions"][2]["reward"] = "high"
    lines[1] = json.dumps(bad)
    (run / "samples.jsonl").write_text("\n".join(lines) + "\n")
    with pytest.raises(ValueError, match=r"samples.jsonl:2: .*completions\[2\].reward"):
        write_report(run)


def test_inspector_caps_groups_and_long_text(run_factory, monkeypatch):
    monkeypatch.setattr(inspector, "MAX_GROUPS", 1)
    monkeypatch.setattr(inspector, "MAX_CHARS", 10)
    text = write_report(run_factory()).read_text(encoding="utf-8")
    assert text.count("showing 1 of 2 prompt groups") == 2
    assert "more characters not shown" in text


def test_choose_steps_keeps_first_middle_last():
    assert choose_steps([3, 1, 2, 2]) == [1, 2, 3]
    chosen = choose_steps(range(100), n=5)
    assert chosen[0] == 0 and chosen[-1] == 99 and len(chosen) == 5
    assert chosen == sorted(set(chosen)) and 40 <= chosen[2] <= 60


def test_dedupe_by_step_keeps_last_row():
    rows = [{"step": 0, "x": 1}, {"step": 1, "x": 2}, {"step": 2, "x": 3}, {"step": 1, "x": 9}]
    assert dedupe_by_step(rows) == [{"step": 0, "x": 1}, {"step": 1, "x": 9}, {"step": 2, "x": 3}]


def test_missing_run_dir_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        write_report(tmp_path / "nope")
