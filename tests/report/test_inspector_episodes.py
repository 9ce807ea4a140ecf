"""The rollout inspector and samples.jsonl schema for multi-turn agent episodes (`completions[i].episode`)."""

import json
from html.parser import HTMLParser

import pytest

from grpolab.report import inspector
from grpolab.report.html import write_report
from grpolab.report.inspector import render_inspector
from grpolab.report.schema import validate_sample_row


def episode(stop_reason="done", tool_errors=0):
    return {
        "turns": 2, "tool_calls": 1, "tool_errors": tool_errors, "stop_reason": stop_reason,
        "env_reward": 0.5,
        "segments": [
            {"source": "prompt", "text": "<|im_start|>user\nAdd 2 and 3.<|im_end|>\n", "tokens": 9},
            {"source": "policy", "text": "<tool_call>add(2, 3)</tool_call>", "tokens": 7},
            {"source": "env", "text": "<|im_start|>tool\n<b>5</b> & done<|im_end|>\n", "tokens": 8},
            {"source": "policy", "text": "The answer is 5.", "tokens": 5},
        ]}


def group(step=0, with_episode=True):
    comps = []
    for i in range(2):
        c = {"text": f"The answer is {5 + i}.", "rewards": {"acc": 1.0 - i}, "reward": 1.0 - i,
             "advantage": 0.7 - 1.4 * i, "length": 12, "truncated": False}
        if with_episode:
            c["episode"] = episode("done" if i == 0 else "max_turns", tool_errors=i)
        comps.append(c)
    return {"step": step, "prompt": "Add 2 and 3.", "meta": {}, "completions": comps}


class Segments(HTMLParser):
    """Text and label of every element with a data-source attribute (the episode's segments), in order."""

    def __init__(self, text: str):
        super().__init__()
        self.segments: list[dict] = []
        self._depth = -1
        self.feed(text)

    def handle_starttag(self, tag, attrs):
        attrs = dict(attrs)
        if "data-source" in attrs:
            self.segments.append({"source": attrs["data-source"], "class": attrs.get("class", ""), "text": ""})
            self._depth = 0
        if self._depth >= 0 and tag in ("div", "details"):
            self._depth += 1

    def handle_endtag(self, tag):
        if self._depth > 0 and tag in ("div", "details"):
            self._depth -= 1
            if self._depth == 0:
                self._depth = -1  # the segment ended: ignore text until the next one

    def handle_data(self, data):
        if self._depth > 0:
            self.segments[-1]["text"] += data


def write_samples(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def test_episode_renders_segments_in_order(tmp_path):
    html = render_inspector(write_samples(tmp_path / "samples.jsonl", [group()]))
    segs = Segments(html).segments
    assert [s["source"] for s in segs] == ["prompt", "policy", "env", "policy"] * 2
    policy = [s for s in segs if s["source"] == "policy"]
    assert "seg-policy" in policy[0]["class"]
    assert policy[0]["text"] == "policy · turn 1 · 7 tokens (trained)<tool_call>add(2, 3)</tool_call>"
    assert policy[1]["text"] == "policy · turn 2 · 5 tokens (trained)The answer is 5."
    env = segs[2]
    assert "seg-policy" not in env["class"]
    assert env["text"] == "environment · 8 tokens (context, not trained)<|im_start|>tool\n<b>5</b> & done<|im_end|>\n"
    assert segs[0]["text"].startswith("prompt · 9 tokens (context, not trained)<|im_start|>user\n")
    # Model text is escaped: no tags from the episode reach the page.
    assert "<b>5</b>" not in html and "<tool_call>" not in html and "<|im_start|>" not in html
    assert "&lt;b&gt;5&lt;/b&gt; &amp; done" in html
    # The stats line; a stop reason other than done and tool errors are flagged.
    assert "turns 2 · tool calls 1 · tool errors 0 · stop reason done · env reward 0.5" in html
    assert ('tool errors <span class="flag">1</span> · stop reason <span class="flag">max_turns</span>'
            in html)
    # The episode replaces the plain text; scores stay in the table.
    assert '<pre class="comp">' not in html
    assert html.count('<div class="episode">') == 2 and "<th>acc</th>" in html


def test_episode_segments_are_cut_at_max_chars(tmp_path, monkeypatch):
    monkeypatch.setattr(inspector, "MAX_CHARS", 10)
    html = render_inspector(write_samples(tmp_path / "samples.jsonl", [group()]))
    assert "&lt;tool_cal" in html and "add(2, 3)" not in html
    assert "more characters not shown" in html


def test_report_mixes_episode_and_plain_groups(run_factory):
    run = run_factory()
    with (run / "samples.jsonl").open("a", encoding="utf-8") as f:
        f.write(json.dumps(group(step=0)) + "\n")
    text = write_report(run).read_text(encoding="utf-8")
    assert text.count('<pre class="comp">') == 16  # the plain groups as before
    assert text.count('<div class="episode">') == 2


def test_completions_without_episode_render_as_before(tmp_path):
    html = render_inspector(write_samples(tmp_path / "samples.jsonl", [group(with_episode=False)]))
    assert html.count('<pre class="comp">The answer is 5.</pre>') == 1
    assert "episode" not in html and "data-source" not in html


def test_validate_accepts_episode_and_null_env_reward():
    row = group()
    row["completions"][0]["episode"]["env_reward"] = None
    row["completions"][1]["episode"]["segments"] = []
    validate_sample_row(row)
    validate_sample_row(group(with_episode=False))


@pytest.mark.parametrize("edit, message", [
    (lambda ep: ep.update(turns="2"), r"completions\[1\]\.episode\.turns must be an integer >= 0"),
    (lambda ep: ep.update(tool_calls=True), r"completions\[1\]\.episode\.tool_calls must be an integer"),
    (lambda ep: ep.update(tool_errors=-1), r"completions\[1\]\.episode\.tool_errors must be an integer >= 0"),
    (lambda ep: ep.pop("stop_reason"), r"completions\[1\]\.episode\.stop_reason must be a string"),
    (lambda ep: ep.update(env_reward="high"), r"completions\[1\]\.episode\.env_reward must be a number or null"),
    (lambda ep: ep.update(env_reward=float("nan")), r"completions\[1\]\.episode\.env_reward must be a number"),
    (lambda ep: ep.update(segments={}), r"completions\[1\]\.episode\.segments must be a list"),
    (lambda ep: ep["segments"].__setitem__(3, "x"), r"completions\[1\]\.episode\.segments\[3\] must be an object"),
    (lambda ep: ep["segments"][3].update(source="tool"),
     r"completions\[1\]\.episode\.segments\[3\]\.source must be one of prompt, policy, env"),
    (lambda ep: ep["segments"][2].update(text=None),
     r"completions\[1\]\.episode\.segments\[2\]\.text must be a string"),
    (lambda ep: ep["segments"][1].update(tokens=1.5),
     r"completions\[1\]\.episode\.segments\[1\]\.tokens must be an integer >= 0"),
])
def test_bad_episode_field_names_completion_and_field(edit, message):
    row = group()
    edit(row["completions"][1]["episode"])
    with pytest.raises(ValueError, match="samples row: " + message):
        validate_sample_row(row)


def test_episode_not_an_object_is_rejected():
    row = group()
    row["completions"][0]["episode"] = [1]
    with pytest.raises(ValueError, match=r"completions\[0\]\.episode must be an object"):
        validate_sample_row(row)


def test_bad_episode_line_names_file_and_line(tmp_path):
    bad = group(step=0)
    bad["completions"][1]["episode"]["segments"][3]["source"] = "tool"
    path = write_samples(tmp_path / "samples.jsonl", [group(step=0), bad])
    with pytest.raises(ValueError, match=r"samples.jsonl:2: samples row: completions\[1\]\.episode"
                                         r"\.segments\[3\]\.source must be one of prompt, policy, env"):
        render_inspector(path)
