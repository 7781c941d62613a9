"""Start-up imports mlx-lm on a background thread when an in-process MLX model will need it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

_SCRIPT = """
import os, sys, threading
from mlxd.config import ModelConfig
from mlxd.engines import DefaultEngines

kind = sys.argv[1]
model = {
    "thread": ModelConfig(name="m", source="/nowhere"),
    "process": ModelConfig(name="m", source="/nowhere", isolation="process"),
    "fake": ModelConfig(name="m", source="/nowhere", engine="fake"),
}[kind]
assert "mlx_lm" not in sys.modules
DefaultEngines().import_soon([model])
from mlxd.engines.runtime import imports_ahead
imports_ahead.wait()
print("mlx_lm.generate" in sys.modules, flush=True)
# a bare script whose mlx-lm was imported off the main thread aborts in the interpreter's
# teardown of MLX's statics about 1 run in 3 ("terminate called without an active
# exception"); the worker process skips that teardown the same way (mlxd/engines/workers/worker.py)
os._exit(0)
"""


def _imported(kind: str) -> bool:
    r = subprocess.run(
        [sys.executable, "-c", _SCRIPT, kind], capture_output=True, text=True, timeout=180
    )
    assert r.returncode == 0, r.stderr
    return r.stdout.strip() == "True"


def test_an_in_process_mlx_model_gets_mlx_lm_imported_ahead_of_its_first_load() -> None:
    assert _imported("thread")


def test_fake_and_worker_process_models_leave_the_daemon_without_mlx_lm() -> None:
    assert not _imported("fake")
    assert not _imported("process")


_LOAD_SCRIPT = """
import json, os, sys, threading
import trio
from mlxd.config import ModelConfig
from mlxd.engines.runtime import memory
from mlxd.engines.mlx_text import MlxTextEngine

threads_at_cap = []
real_cap = memory.limit_malloc_arenas

def cap():
    threads_at_cap.append(sorted(t.name for t in threading.enumerate()))
    return real_cap()

memory.limit_malloc_arenas = cap
importer = None
if sys.argv[2] == "ahead":  # as the daemon does at start-up
    from mlxd.engines.runtime import imports_ahead
    imports_ahead.start()
    (importer,) = [t.ident for t in threading.enumerate() if t.name == "mlxd-import"]
    imports_ahead.wait()  # ended before the first load (a load during it waits off the loop)

async def main():
    engine = MlxTextEngine(ModelConfig(name="m", source=sys.argv[1]))
    await engine.load(lambda _p: None)
    names = sorted(t.name for t in threading.enumerate())
    loaded_on = engine._thread.ident
    await engine.stop()
    return names, loaded_on

after_load, loaded_on = trio.run(main)
print(json.dumps({"at_cap": threads_at_cap[0], "after_load": after_load,
                  "on_importer": loaded_on == importer}), flush=True)
os._exit(0)  # as above: MLX's statics, used off the main thread
"""


@pytest.mark.parametrize("imports", ["ahead", "at_load"])
def test_a_load_caps_malloc_arenas_before_its_first_thread_and_hops_no_thread_to_wait(
    tiny_model_dir: Path, imports: str
) -> None:
    # A thread started before the cap keeps an arena of its own, which a later MLX thread
    # may be handed (mlxd.engines.runtime.memory); a load with nothing left to wait for starts no
    # Trio worker thread to wait on it; after an import ahead it runs on the importing thread
    r = subprocess.run(
        [sys.executable, "-c", _LOAD_SCRIPT, str(tiny_model_dir), imports],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen["at_cap"] == ["MainThread"]
    assert seen["after_load"] == ["MainThread", "mlx-m"]  # the model's MLX thread, nothing else
    assert seen["on_importer"] is (imports == "ahead")
