"""README.md: at most 250 lines, and its "From Python" script runs as written (with tiny sizes and steps
merged into its make_config, so that it takes seconds): it trains, its callback is called, it evaluates."""

from pathlib import Path

import grpolab.api.configs as configs

README = Path(__file__).resolve().parents[1] / "README.md"
TINY = {"model.hidden_size": 32, "model.num_layers": 2, "model.num_heads": 2, "rollout.prompts_per_step": 2,
        "rollout.group_size": 2, "train.steps": 2, "train.minibatch_size": 4, "train.microbatch_size": 4,
        "run.progress": False, "run.tensorboard": False}


def _snippet(heading: str) -> str:
    text = README.read_text()
    after = text[text.index(heading):]
    start = after.index("```python\n") + len("```python\n")
    return after[start:after.index("```", start)]


def test_readme_is_at_most_250_lines():
    assert len(README.read_text().splitlines()) <= 250


def test_the_from_python_script_runs_as_written(tmp_path, monkeypatch, capsys):
    code = _snippet("## From Python")
    assert "def reward(prompts, completions, metadata)" in code and "grpolab.train(" in code
    assert len(code.splitlines()) <= 16
    import grpolab.api.runs  # noqa: F401  (imported before the patch: its own make_config stays the real one)

    real = configs.make_config
    made = []

    def tiny(source=None, overrides=None):
        cfg = real(source, {**dict(overrides or {}), **TINY})
        made.append(cfg)
        return cfg

    monkeypatch.setattr(configs, "make_config", tiny)
    monkeypatch.setenv("GRPOLAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.chdir(tmp_path)
    scope: dict = {}
    exec(compile(code, str(README), "exec"), scope)
    result = scope["result"]
    assert made and made[0].train.steps == 2 and made[0].run.out_dir == "runs/py"
    assert result.run_dir == Path("runs/py") and len(result.metrics) == 2
    assert "reward/reward/mean" in result.metrics[0]  # the inline reward, by its name
    assert (tmp_path / "runs" / "py" / "final" / "config.json").is_file()
    out = capsys.readouterr().out
    assert "runs/py/final" in out and "reward" in out  # the two print lines: the result, the evaluation
