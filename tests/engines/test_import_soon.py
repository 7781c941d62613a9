"""Start-up imports mlx-lm on a background thread when an in-process MLX model will need it."""

from __future__ import annotations

import subprocess
import sys

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
for t in threading.enumerate():
    if t.name == "mlxd-import":
        t.join(120)
print("mlx_lm.generate" in sys.modules, flush=True)
# a bare script whose mlx-lm was imported off the main thread aborts in the interpreter's
# teardown of MLX's statics about 1 run in 3 ("terminate called without an active
# exception"); the worker process skips that teardown the same way (mlxd/engines/worker.py)
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
