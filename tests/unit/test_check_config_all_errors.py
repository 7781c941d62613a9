"""``mlxd check-config`` reports every mistake of a file in one run, and refuses a model that can never fit."""

from __future__ import annotations

from pathlib import Path

import pytest

from mlxd.cli import main

FIVE_MISTAKES = """\
server:
  port: 99999
journal:
  synchronous: sometimes
manager:
  memory_budget_gb: 8
  eviction: random
models:
  - name: a
    engine: fake
    estimated_memory_gb: 1
    max_queue: 0
  - name: b
    engine: fake
    estimated_memory_gb: 1
    pinn: true
"""


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MLXD_STATE_DIR", str(tmp_path / "state"))


def test_five_different_mistakes_are_five_errors_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A file with five mistakes in five places prints five one-line errors (key path and line) and exits 2."""
    path = tmp_path / "models.yaml"
    path.write_text(FIVE_MISTAKES)
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    lines = err.strip().splitlines()
    assert out == ""
    assert lines[0] == "mlxd: 5 errors:"
    expected = [
        ("server.port", 2),
        ("journal.synchronous", 4),
        ("manager.eviction", 7),
        ("models[0].max_queue", 12),
        ("models[1].pinn", 16),
    ]
    assert len(lines) == 1 + len(expected), err
    for line, (key, number) in zip(lines[1:], expected, strict=True):
        assert line.startswith(f"mlxd: {key}: "), line
        assert line.endswith(f"({path}, line {number})"), line
    assert "did you mean 'pin'?" in lines[-1]


def test_a_model_that_can_never_fit_is_an_error_unless_allowed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A model larger than the whole budget exits 2 naming it and the fix; --allow-unfit makes it a warning."""
    path = tmp_path / "models.yaml"
    path.write_text(
        "manager:\n  memory_budget_gb: 1\nmodels:\n"
        "  - {name: small, engine: fake, estimated_memory_gb: 0.5}\n"
        "  - {name: huge, engine: fake, estimated_memory_gb: 2}\n"
    )
    assert main(["check-config", str(path)]) == 2
    out, err = capsys.readouterr()
    assert err.strip().splitlines() == [
        "mlxd: models[1] (huge): can never fit: 2.00 GiB > the 1.00 GiB budget (every request for "
        "it would fail with model_exceeds_budget); raise manager.memory_budget_gb, lower the "
        "model's estimate, or pass --allow-unfit"
    ]
    assert "huge can never fit" in out  # the report is still printed
    assert main(["check-config", "--allow-unfit", str(path)]) == 0
    out, err = capsys.readouterr()
    assert err == ""
    assert "WARNING: huge can never fit" in out
