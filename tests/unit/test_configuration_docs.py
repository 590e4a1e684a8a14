"""docs/configuration.md is what the settings classes render, and every setting says what it does."""

import ast
from pathlib import Path

import pytest
from pydantic import ValidationError

from commands import config_docs

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("schemas", "tinkerq", "producer", "worker", "commands")


def test_the_page_is_what_the_code_renders() -> None:
    assert config_docs.DOC.read_text() == config_docs.render(), (
        "docs/configuration.md and the settings classes disagree: run `python -m commands.config_docs`")


@pytest.mark.parametrize("cls", config_docs.SETTINGS, ids=lambda cls: cls.__name__)
def test_every_setting_has_a_description(cls: type) -> None:
    missing = [name for name, field in cls.model_fields.items() if not (field.description or "").strip()]
    assert not missing, f"{cls.__name__}: settings without Field(description=...): {missing}"
    assert (cls.__doc__ or "").strip(), f"{cls.__name__} has no docstring to say what it configures"


def test_every_settings_class_is_rendered() -> None:
    """A settings class added anywhere in the code (found by its source, so nothing heavy is imported) is in
    the page."""
    found = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.ClassDef) and any(
                        getattr(base, "id", getattr(base, "attr", None)) == "BaseSettings" for base in node.bases):
                    found.add(node.name)
    assert found == {cls.__name__ for cls in config_docs.SETTINGS}


@pytest.mark.parametrize("var", config_docs.OTHER_VARIABLES, ids=lambda var: var.name)
def test_other_variables_are_read_where_the_page_says(var: config_docs.OtherVariable) -> None:
    assert var.name in (ROOT / var.source).read_text()


@pytest.mark.parametrize("cls", config_docs.SETTINGS, ids=lambda cls: cls.__name__)
def test_the_page_names_the_variables_pydantic_reads(cls: type, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each variable the page names reaches its setting: a value no setting but a plain string takes is either
    taken as it is or refused for that very setting."""
    for name, field in cls.model_fields.items():
        with monkeypatch.context() as env:
            env.setenv(config_docs.env_name(cls, name, field), "not-a-setting-value")
            try:
                assert getattr(cls(), name) == "not-a-setting-value", name
            except ValidationError as exc:
                assert {error["loc"][0] for error in exc.errors()} == {name}


def test_check_mode_tells_a_stale_page(tmp_path: Path) -> None:
    page = tmp_path / "configuration.md"
    assert config_docs.main(["--output", str(page)]) == 0
    assert config_docs.main(["--check", "--output", str(page)]) == 0
    page.write_text(page.read_text().replace("`8`", "`9`", 1))
    assert config_docs.main(["--check", "--output", str(page)]) == 1
    assert config_docs.main(["--check", "--output", str(tmp_path / "absent.md")]) == 1
