"""What a newcomer meets in the first minutes, as real CLI processes: messages that say what to do."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

from tests.support.daemon import MLXD, REPO, DaemonProcess, fake_models_config, write_config


def _run(*args: str, env: dict[str, str] | None = None, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*MLXD, *args], capture_output=True, text=True, cwd=REPO,
                          env=env or dict(os.environ), timeout=timeout, check=False)


def test_a_port_in_use_is_named_with_the_way_out(tmp_path: Path) -> None:
    """`mlxd serve` on a port another server holds exits 1 with one line naming the address and the fix."""
    config = write_config(tmp_path / "models.yaml", fake_models_config({"a": 0.1}, 1.0))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = _run("serve", "--config", str(config), "--port", str(port),
                 "--journal", str(tmp_path / "j.db"),
                 env={**os.environ, "MLXD_STATE_DIR": str(tmp_path)})
    assert r.returncode == 1, r.stderr
    assert f"mlxd: cannot serve: 127.0.0.1:{port} is already in use" in r.stderr
    assert "--port" in r.stderr and "Traceback" not in r.stderr


def test_events_says_at_once_that_it_follows(tmp_path: Path) -> None:
    """`mlxd events` prints where it listens as soon as its stream is open, before any event happens."""
    config = write_config(tmp_path / "models.yaml", fake_models_config({"a": 0.1}, 1.0))
    with DaemonProcess(config, tmp_path) as d:
        proc = subprocess.Popen([*MLXD, "events", "--url", d.url], stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, text=True, cwd=REPO)
        try:
            assert proc.stderr is not None
            line = proc.stderr.readline()  # blocks until the command has said it
        finally:
            proc.terminate()
            out, _ = proc.communicate(timeout=10)
    assert line == f"following events of {d.url} (Ctrl-C to stop)\n"
    assert out == ""  # nothing happened, so nothing on stdout


def test_demo_model_embedding_prints_no_pytorch_advice(tmp_path: Path) -> None:
    """`mlxd demo-model --embedding` prints its own progress only (mlxd never runs on PyTorch)."""
    t0 = time.monotonic()
    r = _run("demo-model", str(tmp_path / "emb"), "--embedding", timeout=300)
    assert r.returncode == 0, r.stderr
    assert "PyTorch" not in r.stderr + r.stdout, (r.stderr, time.monotonic() - t0)
    assert "demo-model: wrote" in r.stderr + r.stdout
