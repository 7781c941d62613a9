"""The memory budget report: check-config's words, the ceiling reconciliation, journal estimates."""

from __future__ import annotations

import logging
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd.cli import main
from mlxd.config import ContentionPolicy, JournalConfig, Measurement, load_config, parse_config
from mlxd.config.budget import (
    MemoryBudgetReport,
    build_memory_budget_report,
    describe_budget,
    describe_ceiling,
    describe_policy,
    log_memory_budget_report,
    render_report,
)
from mlxd.journal.reads import journal_measurements
from mlxd.resources import migrations_dir
from mlxd.units import GIB, format_bytes

ETC = Path(__file__).resolve().parents[2] / "etc"
NO_HOST = (None, None)


@pytest.fixture(autouse=True)
def state_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Every test gets its own state directory (so no real journal is read)."""
    state = tmp_path / "state"
    monkeypatch.setenv("MLXD_STATE_DIR", str(state))
    return state


def config_of(models: str, *, budget_gb: float = 8, manager: str = "") -> object:
    import yaml

    return yaml.safe_load(f"manager:\n  memory_budget_gb: {budget_gb}\n{manager}models:\n{models}")


def sentences(pairs: list[tuple[int, str]]) -> str:
    return "\n".join(text for _, text in pairs)


def warnings_of(pairs: list[tuple[int, str]]) -> list[str]:
    return [text for level, text in pairs if level >= logging.WARNING]


# ---- check-config ------------------------------------------------------------------------


def test_check_config_prints_budget_and_every_model(capsys: pytest.CaptureFixture[str]) -> None:
    """``mlxd check-config`` exits 0 and names the file, the budget, each model and its estimate."""
    rc = main(["check-config", str(ETC / "models.yaml")])
    out, err = capsys.readouterr()
    assert rc == 0 and err == ""
    assert f"Config: {(ETC / 'models.yaml').absolute()}: valid." in out
    assert "Memory budget: 4.00 GiB (4294967296 bytes)." in out
    for name, source, estimate in [
        ("qwen", "mlx-community/Qwen2.5-0.5B-Instruct-4bit", "512.0 MiB"),
        ("llama", "mlx-community/Llama-3.2-1B-Instruct-4bit", "1.00 GiB"),
        ("qwen-vl", "mlx-community/Qwen2-VL-2B-Instruct-4bit", "2.00 GiB"),
    ]:
        assert f"  {name}: {source} (Hugging Face Hub" in out
        assert f"weights {estimate} (from estimated_memory_gb)" in out
    assert "engine mlx (vision, mlx-vlm)" in out
    # qwen sets kv_cache_gb and prompt_cache_gb: they are committed with its weights
    assert (
        "commits 819.2 MiB when loaded: weights 512.0 MiB (from estimated_memory_gb) + "
        "KV cache 204.8 MiB + prompt cache 102.4 MiB (from kv_cache_gb and prompt_cache_gb)" in out
    )
    assert "The estimates add up to 3.80 GiB of the 4.00 GiB budget: all models fit at once." in out
    assert (
        "Contention policy: wait_then_fail: a request that does not fit waits up to 30 s for "
        "room, then gets 503 capacity_timeout" in out
    )
    assert "Memory ceiling:" in out


def test_check_config_lists_ignored_vllm_keys(capsys: pytest.CaptureFixture[str]) -> None:
    """check-config on a vllm-mlx file lists each model's ignored engine keys and the warnings."""
    assert main(["check-config", str(ETC / "vllm-mlx.models.yaml")]) == 0
    out = capsys.readouterr().out
    assert (
        "ignored vllm-mlx keys: continuous_batching, prefill_step_size, stream_interval, "
        "gpu_memory_utilization, max_tokens" in out
    )
    assert "Warnings (12):" in out
    assert "  - models[1].specprefill (qwen3-30b-a3b): vllm-mlx engine key, ignored by mlxd" in out


def test_check_config_demo_shows_fakes_and_eviction(capsys: pytest.CaptureFixture[str]) -> None:
    """The demo config's report says the models do not all fit at once (eviction will happen)."""
    assert main(["check-config", str(ETC / "models.demo.yaml")]) == 0
    out = capsys.readouterr().out
    assert "fake-a: no weights (fake engine)" in out
    assert "local demo model, written on first load" in out
    assert "more than the 600.0 MiB budget: not all models fit at once" in out


def test_check_config_uses_journal_measurements(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A Hub model without an estimate passes check-config once the journal has measured it."""
    journal = tmp_path / "journal.db"
    make_journal(journal, [("q", 1.0, 111), ("q", 2.0, 3 * GIB)])
    text = (
        f"journal: {{path: {journal}}}\nmanager: {{memory_budget_gb: 8}}\n"
        "models:\n  - {name: q, path: mlx-community/Qwen2.5-0.5B-Instruct-4bit}\n"
    )
    path = tmp_path / "m.yaml"
    path.write_text(text)
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    assert "weights 3.00 GiB (measured after its last load, from the journal)" in out


def test_check_config_never_writes_the_journal(tmp_path: Path) -> None:
    """check-config with a journal path that does not exist leaves it not existing."""
    journal = tmp_path / "nope" / "journal.db"
    path = tmp_path / "m.yaml"
    path.write_text(
        f"journal: {{path: {journal}}}\nmanager: {{memory_budget_gb: 8}}\n"
        "models:\n  - {name: f, engine: fake, estimated_memory_gb: 1}\n"
    )
    assert main(["check-config", str(path)]) == 0
    assert not journal.exists() and not journal.parent.exists()


def test_import_does_not_import_mlx() -> None:
    """Importing the report module (as ``mlxd --help`` paths do) does not import MLX."""
    code = "import sys, mlxd.config.budget, mlxd.cli; print('mlx' in sys.modules)"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert proc.stdout.strip() == "False"


# ---- journal measurements ----------------------------------------------------------------


def make_journal(
    path: Path,
    rows: list[tuple[str, float, int]],
    weights: list[tuple[str, float, str]] | None = None,
    *,
    version: int | None = None,
) -> None:
    """A journal (at the latest schema, or ``version``) with these measurements and fingerprints."""
    con = sqlite3.connect(path)
    for sql in sorted(migrations_dir().glob("*.sql"))[:version]:
        con.executescript(sql.read_text())
    con.executemany(
        "INSERT INTO measurements(model, at, memory_bytes, load_seconds) VALUES (?, ?, ?, 1.0)",
        rows,
    )
    if weights:
        con.executemany(
            "INSERT INTO measurement_weights(model, at, weights) VALUES (?, ?, ?)", weights
        )
    con.commit()
    con.close()


def test_journal_measurements_takes_the_latest_per_model(tmp_path: Path) -> None:
    """The newest measurement of each model wins, with its own weights; non-positive sizes are skipped."""
    path = tmp_path / "j.db"
    rows = [("a", 2.0, 200), ("a", 1.0, 100), ("b", 5.0, 50), ("c", 1.0, 0)]
    make_journal(path, rows, [("a", 1.0, "old"), ("a", 2.0, "new"), ("c", 1.0, "c")])
    assert journal_measurements(JournalConfig(path)) == {
        "a": Measurement(200, "new"),
        "b": Measurement(50, None),
    }


def test_journal_measurements_of_a_journal_before_v3(tmp_path: Path) -> None:
    """A journal not migrated to v3 yet (no measurement_weights) gives its sizes with unknown weights."""
    path = tmp_path / "j.db"
    make_journal(path, [("a", 2.0, 200)], version=2)
    assert journal_measurements(JournalConfig(path)) == {"a": Measurement(200, None)}


def test_journal_measurements_of_missing_or_garbage_file(tmp_path: Path) -> None:
    """A missing journal or a file that is not a journal gives no measurements."""
    assert journal_measurements(JournalConfig(tmp_path / "missing.db")) == {}
    garbage = tmp_path / "garbage.db"
    garbage.write_bytes(b"this is not sqlite" * 100)
    assert journal_measurements(JournalConfig(garbage)) == {}
    empty = tmp_path / "empty.db"
    sqlite3.connect(empty).close()
    assert journal_measurements(JournalConfig(empty)) == {}


# ---- the budget findings -----------------------------------------------------------------


def test_model_larger_than_budget_can_never_fit() -> None:
    """A model whose estimate exceeds the budget is named with model_exceeds_budget."""
    config = parse_config(
        config_of(
            "  - {name: big, path: org/big, estimated_memory_gb: 10}\n"
            "  - {name: small, path: org/small, estimated_memory_gb: 1}\n"
        )
    )
    pairs = describe_budget(config)
    assert warnings_of(pairs) == [
        "big can never fit (10.00 GiB > the 8.00 GiB budget): requests for it fail at once "
        "with 400 model_exceeds_budget."
    ]


def test_pinned_over_budget_and_room_left_by_pins() -> None:
    """Pinned models over the budget are flagged; a model that cannot load beside the pins is named."""
    over = parse_config(
        config_of(
            "  - {name: a, path: org/a, estimated_memory_gb: 5, pin: true}\n"
            "  - {name: b, path: org/b, estimated_memory_gb: 5, pin: true}\n"
        )
    )
    assert any(
        "Pinned" in w and "can never all be resident" in w
        for w in warnings_of(describe_budget(over))
    )
    room = parse_config(
        config_of(
            "  - {name: a, path: org/a, estimated_memory_gb: 6, pin: true, preload: true}\n"
            "  - {name: b, path: org/b, estimated_memory_gb: 3}\n"
        )
    )
    text = sentences(describe_budget(room))
    assert (
        "b (3.00 GiB) cannot load while every pinned model is resident (they leave 2.00 GiB)." in text
    )
    assert "Preloaded at start-up: a, 6.00 GiB in all; that fits the budget." in text


def test_preloads_over_budget_warn() -> None:
    """Preloaded models that together exceed the budget get a warning."""
    config = parse_config(
        config_of(
            "  - {name: a, path: org/a, estimated_memory_gb: 5, preload: true}\n"
            "  - {name: b, path: org/b, estimated_memory_gb: 5, preload: true}\n"
        )
    )
    assert any(
        w.startswith("Preloaded at start-up: a, b, 10.00 GiB in all, more than")
        for w in warnings_of(describe_budget(config))
    )


@pytest.mark.parametrize(
    ("policy", "expected"),
    [
        (
            ContentionPolicy.of("fail"),
            "fail: a request that does not fit gets 503 model_capacity at once",
        ),
        (
            ContentionPolicy.of("wait"),
            "wait: a request that does not fit waits for room without a time limit",
        ),
        (
            ContentionPolicy.of("wait", wait_timeout_s=5),
            "wait: a request that does not fit waits up to 5 s for room, then gets 503 capacity_timeout",
        ),
        (
            ContentionPolicy.of("wait_then_fail"),
            "wait_then_fail: a request that does not fit waits up to 30 s for room, then gets 503 capacity_timeout",
        ),
        (
            ContentionPolicy.of("preempt"),
            "preempt: a request that does not fit preempts the requests of the least recently used busy models at once",
        ),
        (
            ContentionPolicy.of("wait_then_preempt", preempt_after_s=5),
            "wait_then_preempt: a request that does not fit waits 5 s for the least recently used busy models to finish, then preempts them",
        ),
    ],
)
def test_policy_in_words(policy: ContentionPolicy, expected: str) -> None:
    """Each strategy is described by what a request that does not fit experiences."""
    assert describe_policy(policy).startswith(expected)


# ---- the ceiling reconciliation ----------------------------------------------------------


def test_no_ceiling_on_cpu_host_shows_ram() -> None:
    """Without a device working set there is no ceiling; the host's RAM is shown as context."""
    config = parse_config(config_of("  - {name: a, path: org/a, estimated_memory_gb: 1}\n"))
    report = build_memory_budget_report(
        config, device_working_set=None, host_memory=(32 * GIB, 20 * GIB)
    )
    assert report.allocation_ceiling_bytes is None and not report.exceeds_ceiling
    text = sentences(describe_ceiling(report))
    assert "no Metal allocation ceiling to reconcile it with" in text
    assert "This host has 32.00 GiB of RAM, 20.00 GiB available now." in text
    assert warnings_of(describe_ceiling(report)) == []


def test_budget_above_host_ram_warns() -> None:
    """A budget larger than the host's RAM is a warning."""
    config = parse_config(
        config_of("  - {name: a, path: org/a, estimated_memory_gb: 1}\n", budget_gb=64)
    )
    report = build_memory_budget_report(
        config, device_working_set=None, host_memory=(16 * GIB, None)
    )
    assert report.exceeds_host_memory
    assert warnings_of(describe_ceiling(report))[0].startswith(
        "The memory budget (64.00 GiB) is larger than this host's RAM (16.00 GiB)"
    )


def test_ceiling_is_lowest_utilization_of_batching_entries() -> None:
    """Only continuous-batching entries' gpu_memory_utilization count, and the lowest wins."""
    config = parse_config(
        config_of(
            "  - {name: a, path: org/a, estimated_memory_gb: 1, continuous_batching: true, gpu_memory_utilization: 0.9}\n"
            "  - {name: b, path: org/b, estimated_memory_gb: 1, continuous_batching: true, gpu_memory_utilization: 0.5}\n"
            "  - {name: c, path: org/c, estimated_memory_gb: 1, gpu_memory_utilization: 0.1}\n"
            "  - {name: d, path: org/d, estimated_memory_gb: 1, continuous_batching: true}\n"
        )
    )
    report = build_memory_budget_report(config, device_working_set=20 * GIB, host_memory=NO_HOST)
    assert report.gpu_memory_utilization == 0.5
    assert report.gpu_memory_utilization_source == "models-config entry 'b'"
    assert (report.continuous_batching_entries, report.total_entries) == (3, 4)
    assert report.allocation_ceiling_bytes == 10 * GIB
    assert not report.exceeds_ceiling
    text = sentences(describe_ceiling(report))
    assert "allocation ceiling 10.00 GiB (50% of the 20.00 GiB device working set" in text
    assert "The budget covers each model's weights, the KV of its running generations" in text


def test_budget_above_ceiling_warns_with_the_seed_advice() -> None:
    """A budget above the ceiling warns that loads can fail with out-of-memory instead of evicting."""
    config = parse_config(
        config_of("  - {name: a, path: org/a, estimated_memory_gb: 1}\n", budget_gb=12)
    )
    report = build_memory_budget_report(config, device_working_set=10 * GIB, host_memory=NO_HOST)
    assert report.allocation_ceiling_bytes == 10 * GIB and report.exceeds_ceiling
    warnings = warnings_of(describe_ceiling(report))
    assert len(warnings) == 1
    assert warnings[0].startswith(
        "The memory budget (12.00 GiB) exceeds the allocation ceiling (10.00 GiB)."
    )
    assert "Lower the budget below 10.00 GiB" in warnings[0]
    assert "The budget covers each model's weights and, for batched text models, the KV" not in sentences(describe_ceiling(report))


def test_report_dataclass_properties() -> None:
    """The ceiling is working set x utilization (1.0 when none), None without a working set."""
    base = MemoryBudgetReport(GIB, 8 * GIB, None, None, 0, 1)
    assert base.allocation_ceiling_bytes == 8 * GIB and not base.exceeds_ceiling
    scaled = MemoryBudgetReport(4 * GIB, 8 * GIB, 0.25, "x", 1, 1)
    assert scaled.allocation_ceiling_bytes == 2 * GIB and scaled.exceeds_ceiling
    assert MemoryBudgetReport(GIB, None, 0.5, "x", 1, 1).allocation_ceiling_bytes is None


def test_render_report_marks_warnings(tmp_path: Path) -> None:
    """The rendered report prefixes warning sentences with WARNING and lists config warnings."""
    path = tmp_path / "m.yaml"
    path.write_text(
        "manager: {memory_budget_gb: 1}\nmodels:\n"
        "  - {name: big, path: org/big, estimated_memory_gb: 2, max_tokens: 10}\n"
    )
    config = load_config(path)
    out = render_report(
        config, build_memory_budget_report(config, device_working_set=None, host_memory=NO_HOST)
    )
    assert "  WARNING: big can never fit" in out
    assert "Warnings (1):\n  - models[0].max_tokens (big): vllm-mlx engine key" in out


def test_log_memory_budget_report_logs_warnings(caplog: pytest.LogCaptureFixture) -> None:
    """The daemon's start-up log carries the never-fit model and config warnings at WARNING."""
    config = parse_config(
        config_of("  - {name: big, path: org/big, estimated_memory_gb: 20, enable_mtp: true}\n")
    )
    report = build_memory_budget_report(config, device_working_set=None, host_memory=NO_HOST)
    with caplog.at_level(logging.INFO, logger="mlxd.config.budget"):
        log_memory_budget_report(config, report)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(m.startswith("big can never fit") for m in warned)
    assert any(m.startswith("config: models[0].enable_mtp (big)") for m in warned)


def test_sizes_print_in_binary_units() -> None:
    """The report writes sizes as every other place does: GiB with two decimals, MiB below 1 GiB."""
    assert format_bytes(4 * GIB) == "4.00 GiB"
    assert format_bytes(GIB // 2) == "512.0 MiB"
    assert format_bytes(GIB // 100) == "10.2 MiB"
    assert format_bytes(512) == "512 B" and format_bytes(None) == "-"


def test_check_config_on_an_embedding_model_shows_weights_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """An embedding model commits its weights only (no KV cache, no prompt cache, no batch),
    even where its config.json would give a 24-layer encoder hundreds of MiB of KV."""
    import json

    import yaml

    model = tmp_path / "encoder"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"model_type": "bert", "num_hidden_layers": 24, "num_attention_heads": 16,
         "hidden_size": 1024, "max_position_embeddings": 512}))
    path = tmp_path / "models.yaml"
    path.write_text(yaml.safe_dump({"manager": {"memory_budget_gb": 8}, "models": [
        {"name": "embed", "path": str(model), "embedding": True, "estimated_memory_gb": 1}]}))
    assert main(["check-config", str(path)]) == 0
    out = capsys.readouterr().out
    block = out.split("embed: ")[1].split("Budget:")[0]
    assert "commits 1.00 GiB when loaded: weights 1.00 GiB" in block, block
    assert "weights only" in block and "KV cache 0" not in block, block
    assert "an embedding model generates nothing" in block, block


def test_kv_cache_gb_is_called_a_cap_only_where_requests_count_their_kv(tmp_path: Path) -> None:
    """check-config calls ``kv_cache_gb`` the cap of a model's running KV for a text model, not
    for a distributed one (its requests count no KV: the eligibility rule) nor for a fake."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text("{}")
    common = {"path": str(model), "estimated_memory_gb": 1, "kv_cache_gb": 0.5, "prompt_cache_gb": 0}
    config = parse_config({"manager": {"memory_budget_gb": 8}, "models": [
        {"name": "t", **common},
        {"name": "d", **common, "distributed": {"hosts": ["127.0.0.1", "127.0.0.1"]}},
        {"name": "f", "engine": "fake", "estimated_memory_gb": 1, "kv_cache_gb": 0.5}]},
        path=tmp_path / "models.yaml")
    report = build_memory_budget_report(config)
    blocks = {name: render_report(config, report).split(f"  {name}: ")[1].split("\n  ")[0:4]
              for name in ("t", "d", "f")}
    cap = "kv_cache_gb is a fixed KV region"
    assert [any(cap in line for line in blocks[n]) for n in ("t", "d", "f")] == [True, False, False], blocks
