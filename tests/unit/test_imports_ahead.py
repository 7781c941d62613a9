"""transformers' source scan: once per process, kept on disk while its files are unchanged.

:class:`mlxd.engines.runtime.imports_ahead.ScanStore` stands in for transformers'
``create_import_structure_from_path``; here with a scan function that counts
its calls over a small folder tree, then once with the real transformers in
fresh interpreters.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from mlxd.engines.runtime import imports_ahead
from mlxd.engines.runtime.imports_ahead import ScanStore

REPO = Path(__file__).resolve().parents[2]


class CountingScan:
    """A stand-in for transformers' scan: each folder's ``.py`` names, recursively."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.store: ScanStore | None = None

    def __call__(self, folder: str) -> dict[str, Any]:
        self.calls.append(folder)
        assert self.store is not None
        out: dict[str, Any] = {frozenset(): {p.stem: {p.stem.upper()} for p in Path(folder).glob("*.py")}}
        for sub in sorted(Path(folder).iterdir()):
            if sub.is_dir():
                out[sub.name] = self.store.scan(str(sub))  # the recursion comes back through the store
        return out


def make_store(package: Path) -> tuple[ScanStore, CountingScan]:
    scan = CountingScan()
    store = ScanStore(scan, package)
    scan.store = store
    return store, scan


@pytest.fixture
def package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv(imports_ahead.CACHE_ENV, raising=False)
    root = tmp_path / "transformers"
    for name in ("models/albert/configuration_albert.py", "models/bert/tokenization_bert.py"):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text("__all__ = []\n")
    return root


def test_each_folder_is_scanned_once_per_process(package: Path) -> None:
    """A folder asked for again (as a folder, or as a file in it) is answered from memory."""
    store, scan = make_store(package)
    models = package / "models"
    first = store.scan(models)
    assert store.scan(str(models / "albert" / "configuration_albert.py")) is first["albert"]
    assert store.scan(str(models)) is first
    assert sorted(Path(c).name for c in scan.calls) == ["albert", "bert", "models"]


def test_a_later_process_reads_the_scan_while_the_files_are_unchanged(package: Path) -> None:
    """Saved results answer a new store without a scan; an edited file makes it scan again."""
    store, _ = make_store(package)
    expected = store.scan(str(package / "models"))
    store.save()
    assert store.path is not None and store.path.is_file()
    again, scan = make_store(package)
    assert again.scan(str(package / "models")) == expected
    assert scan.calls == []
    edited = package / "models" / "bert" / "tokenization_bert.py"
    edited.write_text("__all__ = ['BertTokenizer']\n")
    os.utime(edited, ns=(1, 1))
    changed, scan = make_store(package)
    changed.scan(str(package / "models"))
    assert len(scan.calls) == 3


def test_an_unreadable_cache_falls_back_to_scanning(package: Path) -> None:
    """A cache file cut short (or of another format) is ignored and rewritten."""
    store, _ = make_store(package)
    store.scan(str(package / "models"))
    store.save()
    assert store.path is not None
    store.path.write_bytes(store.path.read_bytes()[:20])
    again, scan = make_store(package)
    again.scan(str(package / "models"))
    assert len(scan.calls) == 3
    again.save()
    third, scan = make_store(package)
    third.scan(str(package / "models"))
    assert scan.calls == []


def test_the_disk_cache_can_be_turned_off(package: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(imports_ahead.CACHE_ENV, "0")
    store, _ = make_store(package)
    store.scan(str(package / "models"))
    store.save()
    assert store.path is None
    assert not (package.parent / "cache").exists()


PROBE = """
import json, sys
if sys.argv[1] == "scan_once":
    from mlxd.engines.runtime import imports_ahead
    imports_ahead.scan_once()
import transformers
from transformers import AutoTokenizer  # noqa: F401  (imports transformers.models)
import transformers.models as models
if sys.argv[1] == "scan_once":
    imports_ahead.save_scans()
tables = {}
for m in (transformers, models):
    tables[m.__name__] = sorted(m._class_to_module.items()), sorted(m._modules)
print(json.dumps(tables))
"""


def test_transformers_lazy_tables_are_the_same_with_the_scan_cached(tmp_path: Path) -> None:
    """With the scan cached (first without, then with a cache file), transformers' lazy
    modules map every name to the module a plain import maps it to."""
    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "PYTHONPATH": str(REPO)}
    env.pop(imports_ahead.CACHE_ENV, None)

    def tables(mode: str) -> Any:
        out = subprocess.run(
            [sys.executable, "-c", PROBE, mode], env=env, capture_output=True, text=True, check=True
        )
        return json.loads(out.stdout)

    plain = tables("plain")
    assert tables("scan_once") == plain  # scanned once, and saved
    assert list((tmp_path / "mlxd").glob("transformers-scan-*.marshal"))
    assert tables("scan_once") == plain  # answered from the file
