"""A measured size belongs to the weights it was measured on, not to the model's name (issue 17, item 8).

Through the real ``mlxd serve`` and ``mlxd check-config``: two real models of
different sizes are measured, then swap paths in the config; a weight file is
changed under a measured model. The estimates the daemon budgets with and the
CLI prints must come from the weights as they are now.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

import httpx

from mlxd.config import weights_bytes
from tests.support.daemon import MLXD, REPO, DaemonProcess, write_config


def one_layer_copy(tiny: Path, out: Path) -> Path:
    """``tiny`` (two layers) cut to its first layer: a smaller real model."""
    import mlx.core as mx

    shutil.copytree(tiny, out)
    weights = mx.load(str(out / "model.safetensors"))
    assert isinstance(weights, dict)
    kept = {k: v for k, v in weights.items() if not k.startswith("model.layers.1.")}
    mx.save_safetensors(str(out / "model.safetensors"), kept, metadata={"format": "mlx"})
    cfg = json.loads((out / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": 1}))
    return out


def config(paths: dict[str, Path]) -> dict[str, Any]:
    return {
        "manager": {"memory_budget_gb": 1, "restore_on_start": False},
        "models": [{"name": name, "path": str(path)} for name, path in paths.items()],
    }


def estimates(c: httpx.Client) -> dict[str, tuple[str, int]]:
    """Each model's (memory_source, weights bytes) as the daemon budgets it."""
    models = c.get("/v1/models").json()["data"]
    return {m["id"]: (m["memory_source"], m["memory"]["weights"]) for m in models}


def check_config(path: Path, state: Path) -> str:
    done = subprocess.run([*MLXD, "check-config", str(path)], capture_output=True, text=True,
                          cwd=REPO, timeout=60, check=False,
                          env={**os.environ, "MLXD_STATE_DIR": str(state)})
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_swapped_paths_and_changed_weights_do_not_inherit_a_measured_size(
    tiny_model: Path, tmp_path: Path
) -> None:
    """After two measured models swap paths neither inherits the other's measured size, and a changed weight file drops its model's measurement, in the daemon (start and reload) and in check-config."""
    big, small = shutil.copytree(tiny_model, tmp_path / "big"), one_layer_copy(tiny_model, tmp_path / "small")
    path = write_config(tmp_path / "models.yaml", config({"a": big, "b": small}))
    with DaemonProcess(path, tmp_path) as d, httpx.Client(base_url=d.url, timeout=60) as c:
        for name in ("a", "b"):
            assert c.post(f"/admin/models/{name}/load").status_code == 200
        measured = estimates(c)
    assert measured["a"][0] == measured["b"][0] == "measured"
    assert measured["a"][1] > measured["b"][1] > 0, measured

    write_config(path, config({"a": small, "b": big}))  # the two swap paths
    swapped = {"a": ("weights", weights_bytes(str(small))), "b": ("weights", weights_bytes(str(big)))}
    out = check_config(path, tmp_path)
    assert "measured after its last load" not in out and "summed *.safetensors" in out, out
    with DaemonProcess(path, tmp_path) as d, httpx.Client(base_url=d.url, timeout=60) as c:
        assert estimates(c) == swapped
        assert c.post("/admin/models/a/load").status_code == 200
        assert estimates(c)["a"] == ("measured", measured["b"][1])  # the same weights, measured again
        assert c.post("/admin/models/a/unload").status_code == 200
        r = c.post("/admin/reload")
        assert r.status_code == 200 and estimates(c)["a"][0] == "measured", r.text

        weights = small / "model.safetensors"
        st = weights.stat()
        os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))  # a new copy, say
        r = c.post("/admin/reload")
        assert r.status_code == 200 and estimates(c)["a"] == swapped["a"], r.text
        assert c.post("/admin/models/a/load").status_code == 200
        assert estimates(c)["a"][0] == "measured"  # measured on the new file
    assert "measured after its last load" in check_config(path, tmp_path)
    os.utime(weights, ns=(st.st_atime_ns, st.st_mtime_ns + 2_000_000_000))
    out = check_config(path, tmp_path)
    assert "measured after its last load" not in out, out
