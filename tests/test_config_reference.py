"""docs/reference/configuration.md is what `python -m pipeline.config.reference` writes from the config dataclasses
(`make docs`), and every field of every config dataclass in pipeline/config has a meaning (its docstring)."""

from __future__ import annotations

import dataclasses
import inspect
from pathlib import Path

from pipeline import config as C
from pipeline.config import reference


def _config_classes() -> list[type]:
    """Every dataclass defined in a module of the pipeline.config package (registered choices included)."""
    import importlib
    import pkgutil

    classes: dict[str, type] = {}
    for info in pkgutil.iter_modules(C.__path__):
        module = importlib.import_module(f"pipeline.config.{info.name}")
        for _, cls in inspect.getmembers(module, inspect.isclass):
            if dataclasses.is_dataclass(cls) and cls.__module__.startswith("pipeline.config."):
                classes[f"{cls.__module__}.{cls.__qualname__}"] = cls
    return [classes[k] for k in sorted(classes)]


def test_every_config_field_has_a_meaning() -> None:
    classes = _config_classes()
    assert len(classes) > 30
    missing = [
        f"{cls.__module__}.{cls.__qualname__}.{f.name}"
        for cls in classes
        for f in dataclasses.fields(cls)
        if not reference.meaning(cls, f.name)
    ]
    assert not missing, "config fields without a docstring (the string right after the field):\n" + "\n".join(missing)


def test_generated_reference_is_up_to_date() -> None:
    text, missing = reference.render()
    assert not missing
    current = reference.OUTPUT.read_text() if reference.OUTPUT.exists() else ""
    assert current == text, f"{reference.OUTPUT} is stale: run `make docs` (python -m pipeline.config.reference)"


def test_reference_covers_every_registered_choice_and_job_field() -> None:
    text, _ = reference.render()
    for _, registry, _ in reference.CHOICES:
        for name, cls in registry.get_known_choices().items():
            if cls.__module__.split(".")[0] in ("pipeline", "policy"):  # tests register choices of their own
                assert f"{{type: {name}}}` ({cls.__name__})" in text
    for f in dataclasses.fields(C.RLJobConfig):
        assert f"| `{f.name}" in text, f.name
    assert "| `cadence.policy_interval` | `int` | `1` |" in text


def test_check_mode_fails_on_a_stale_file(tmp_path: Path) -> None:
    out = tmp_path / "configuration.md"
    assert reference.main(["--check", "--output", str(out)]) == 1  # missing
    assert reference.main(["--output", str(out)]) == 0
    assert reference.main(["--check", "--output", str(out)]) == 0
    out.write_text(out.read_text() + "edited by hand\n")
    assert reference.main(["--check", "--output", str(out)]) == 1


def test_a_choice_registered_outside_rlpipe_does_not_change_the_reference() -> None:
    """A test or user module registering its own choice in this process (as tests/test_runner_restarts.py does)
    leaves the reference as `make docs` writes it in a fresh process."""
    before, _ = reference.render()

    @C.JobBackendConfig.register_subclass("reference-test-only")
    @dataclasses.dataclass(frozen=True)
    class _Outside(C.JobBackendConfig):
        pass

    assert "reference-test-only" in C.JobBackendConfig.get_known_choices()
    assert reference.render()[0] == before
