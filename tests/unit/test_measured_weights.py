"""Measurements tied to the weights they were measured on (issue 17, item 8): the fingerprint,
the estimate rule, the journal rows (schema v3) and the manager's in-run measurements."""

from __future__ import annotations

import dataclasses
import os
import sqlite3
from pathlib import Path

import trio

from mlxd.config import (
    Config,
    FakeSettings,
    ManagerConfig,
    Measurement,
    ModelConfig,
    resolve_estimate,
    weights_fingerprint,
)
from mlxd.config.model import DistributedHost, DistributedSettings
from mlxd.engines.fake import FakeFleet
from mlxd.journal.migrate import migrate, open_database
from mlxd.journal.reads import read_latest_measurements
from mlxd.journal.rows import encode, plan, prepare
from mlxd.journal.writer import Writer
from mlxd.residency.events import MeasurementEvent
from mlxd.residency.manager import Manager
from mlxd.units import GIB


def model_dir(path: Path, files: dict[str, int]) -> Path:
    for name, size in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_bytes(b"\0" * size)
    return path


def local(name: str, path: Path) -> ModelConfig:
    return ModelConfig(name=name, source=str(path), source_kind="local")


def test_the_fingerprint_follows_the_weight_files_not_the_name(tmp_path: Path) -> None:
    """Same files: same fingerprint, whatever the name or a symlink to them; another path, a file's size or mtime, or one file more: another."""
    a = model_dir(tmp_path / "a", {"model.safetensors": 100, "sub/x.gguf": 7, "config.json": 5})
    b = model_dir(tmp_path / "b", {"model.safetensors": 100, "sub/x.gguf": 7, "config.json": 5})
    (tmp_path / "link").symlink_to(a)
    fp = weights_fingerprint(local("x", a))
    assert weights_fingerprint(local("y", a)) == fp
    assert weights_fingerprint(local("x", tmp_path / "link")) == fp
    assert weights_fingerprint(local("x", b)) != fp
    (a / "config.json").write_text("{}")  # not a weight file
    (a / "README.md").write_text("hello")
    assert weights_fingerprint(local("x", a)) == fp
    st = (a / "model.safetensors").stat()
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    touched = weights_fingerprint(local("x", a))
    assert touched != fp
    model_dir(a, {"model.safetensors": 101})
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns + 1))
    assert weights_fingerprint(local("x", a)) not in (fp, touched)
    model_dir(a, {"model-2.safetensors": 1})
    assert len({weights_fingerprint(local("x", a)), fp, touched}) == 3


def test_the_fingerprint_of_hub_fake_and_distributed_models() -> None:
    """A Hub model is named by its repo id, a fake by its memory setting, a distributed model also by its ranks."""
    hub = ModelConfig(name="q", source="org/model", source_kind="hub")
    assert weights_fingerprint(hub) == weights_fingerprint(dataclasses.replace(hub, name="r"))
    assert weights_fingerprint(hub) != weights_fingerprint(dataclasses.replace(hub, source="org/other"))
    fake = ModelConfig(name="f", source="fake:f", engine="fake", fake=FakeSettings(memory_bytes=GIB))
    bigger = dataclasses.replace(fake, fake=FakeSettings(memory_bytes=2 * GIB))
    assert weights_fingerprint(fake) != weights_fingerprint(bigger)
    assert weights_fingerprint(fake) == weights_fingerprint(dataclasses.replace(fake, name="g"))
    two = DistributedSettings("ring", (DistributedHost("a"), DistributedHost("b")))
    three = dataclasses.replace(two, hosts=(*two.hosts, DistributedHost("c")))
    shard = dataclasses.replace(hub, distributed=two)
    assert weights_fingerprint(shard) != weights_fingerprint(hub)
    assert weights_fingerprint(shard) != weights_fingerprint(dataclasses.replace(hub, distributed=three))


def test_a_measurement_applies_only_to_the_weights_it_was_taken_on(tmp_path: Path) -> None:
    """Measured on other weights: the weight files' sum; without known weights: only where nothing else applies."""
    a = local("a", model_dir(tmp_path / "a", {"model.safetensors": 100}))
    b = local("b", model_dir(tmp_path / "b", {"model.safetensors": 300}))
    mine, theirs = Measurement(555, weights_fingerprint(a)), Measurement(777, weights_fingerprint(b))
    assert resolve_estimate(a, {"a": mine}) == resolve_estimate(a, {"a": mine})
    assert (resolve_estimate(a, {"a": mine}).bytes, resolve_estimate(a, {"a": mine}).source) == (  # type: ignore[union-attr]
        555, "measured",
    )
    assert resolve_estimate(a, {"a": theirs}).source == "weights"  # type: ignore[union-attr]
    assert resolve_estimate(a, {"a": theirs}).bytes == 100  # type: ignore[union-attr]
    assert resolve_estimate(a, {"a": Measurement(555)}).source == "weights"  # type: ignore[union-attr]
    hub = ModelConfig(name="q", source="org/model", source_kind="hub")
    assert resolve_estimate(hub, {}) is None
    assert resolve_estimate(hub, {"q": Measurement(9)}).source == "measured"  # type: ignore[union-attr]
    assert resolve_estimate(hub, {"q": Measurement(9, weights_fingerprint(a))}) is None


def journal(path: Path) -> sqlite3.Connection:
    conn = open_database(path, synchronous="normal")
    migrate(conn)
    return conn


def measurement_rows(conn: sqlite3.Connection) -> list[tuple[object, ...]]:
    return conn.execute(
        "SELECT m.model, m.at, m.memory_bytes, w.weights FROM measurements m"
        " LEFT JOIN measurement_weights w USING (model, at) ORDER BY m.at"
    ).fetchall()


def test_the_writer_journals_the_weights_in_a_batch_and_record_by_record(tmp_path: Path) -> None:
    """A batch and the record-by-record path write the same rows; the latest measurement comes back with its weights."""
    events = [MeasurementEvent("a", 1.0, 10, 0.5, "w1"), MeasurementEvent("a", 2.0, 20, 0.5, "w2"),
              MeasurementEvent("b", 3.0, 30, 0.5)]
    items = [(i + 1, 1, encode(e)) for i, e in enumerate(events)]
    batched, one_by_one = journal(tmp_path / "batch.db"), journal(tmp_path / "each.db")
    Writer._write(batched, plan(items))
    for item in items:
        Writer._apply(one_by_one, prepare(item))
    expected = [("a", 1.0, 10, "w1"), ("a", 2.0, 20, "w2"), ("b", 3.0, 30, None)]
    assert measurement_rows(batched) == measurement_rows(one_by_one) == expected
    assert read_latest_measurements(batched) == {"a": Measurement(20, "w2"), "b": Measurement(30)}


def test_pruning_a_measurement_prunes_its_weights(tmp_path: Path) -> None:
    """Deleting measurements rows (journal retention) deletes their fingerprints with them."""
    conn = journal(tmp_path / "j.db")
    items = [(1, 1, encode(MeasurementEvent("a", 1.0, 10, 0.5, "w1"))),
             (2, 1, encode(MeasurementEvent("a", 2.0, 20, 0.5, "w2")))]
    Writer._write(conn, plan(items))
    conn.execute("DELETE FROM measurements WHERE at < 2.0")
    assert conn.execute("SELECT model, at, weights FROM measurement_weights").fetchall() == [
        ("a", 2.0, "w2")
    ]


async def test_the_manager_measures_with_the_weights_and_follows_the_rule_on_reload(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """A load journals its weights; after a reload that changes a fake's memory, the old measurement no longer applies."""
    def config(gb: float) -> Config:
        fake = FakeSettings(load_seconds=1.0, memory_bytes=int(gb * GIB))
        return Config(manager=ManagerConfig(memory_budget_bytes=8 * GIB),
                      models=(ModelConfig(name="f", source="fake:f", engine="fake", fake=fake),))

    seen: list[object] = []
    manager = Manager(config(1), FakeFleet())
    manager.subscribe(seen.append)
    async with trio.open_nursery() as nursery:
        await nursery.start(manager.run)
        await manager.load("f")
        weights = weights_fingerprint(config(1).models[0])
        assert manager.estimates.measured() == {"f": Measurement(GIB, weights)}
        assert next(e for e in seen if isinstance(e, MeasurementEvent)).weights == weights
        assert manager.model_status("f")["memory_source"] == "measured"
        await manager.unload("f")
        await manager.reload(config(2))
        status = manager.model_status("f")
        assert (status["memory_source"], status["memory_bytes"]) == ("fake", 2 * GIB)
        await manager.shutdown(1)
