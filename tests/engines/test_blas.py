"""A fast BLAS for MLX's CPU backend on Linux (mlxd.blas): chosen, preloaded, same tokens.

The system library is Debian's ``libopenblas0-pthread``; ``make test`` and
``.ci/run`` install it. Where it is missing the tests that need it skip, saying
so, except when ``MLXD_REQUIRE_BLAS=1`` (``.ci/run``), where they fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlxd import blas
from tests.support.daemon import DaemonProcess, write_config

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="MLX's CPU backend is Linux's")


@pytest.fixture(scope="module")
def system_blas() -> Path:
    """Debian's OpenBLAS, or a skip (a failure under MLXD_REQUIRE_BLAS=1)."""
    choice = blas.choose({})
    if choice.library is None:
        if os.environ.get("MLXD_REQUIRE_BLAS") == "1":
            pytest.fail(f"MLXD_REQUIRE_BLAS=1 but {choice.summary}")
        pytest.skip(choice.summary)
    return choice.library


_GREEDY = """
import json, sys
import mlx_lm
from mlx_lm.sample_utils import make_sampler
from mlxd import blas
model, tok = mlx_lm.load(sys.argv[1])
prompt = "The quick brown fox jumps over the lazy dog. " * 40
out = [r.token for r in mlx_lm.stream_generate(model, tok, prompt, max_tokens=32,
                                                sampler=make_sampler(0.0))]
library = blas.choose({}).library
print(json.dumps({"tokens": out, "fast": bool(library and blas.in_use(library))}))
"""


def _greedy(model_dir: Path, env: dict[str, str]) -> dict[str, object]:
    done = subprocess.run([sys.executable, "-c", _GREEDY, str(model_dir)], env=env,
                          capture_output=True, text=True, timeout=300, check=True)
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _without_preload() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("LD_PRELOAD", None)
    return env


def test_choice_follows_the_environment(tmp_path: Path) -> None:
    """MLXD_BLAS=off keeps the reference BLAS, a path is taken as given, a missing one is a warning."""
    assert blas.choose({"MLXD_BLAS": "off"}).library is None
    assert not blas.choose({"MLXD_BLAS": "off"}).missing
    lib = tmp_path / "libblas.so.3"
    lib.write_bytes(b"")
    assert blas.choose({"MLXD_BLAS": str(lib)}).library == lib
    missing = blas.choose({"MLXD_BLAS": str(tmp_path / "nope.so")})
    assert missing.library is None and missing.missing and "nope.so" in missing.summary
    assert blas.choose({}, system="Darwin").library is None
    assert not blas.choose({}, system="Darwin").missing


def test_environment_puts_the_library_first_once(tmp_path: Path) -> None:
    """A child's LD_PRELOAD gets the library in front of what was there, never twice."""
    lib = tmp_path / "libblas.so.3"
    choice = blas.BlasChoice(lib, "")
    env = blas.environment(choice, {"LD_PRELOAD": "/x/other.so"})
    assert env["LD_PRELOAD"] == f"{lib} /x/other.so"
    assert blas.environment(choice, env)["LD_PRELOAD"] == env["LD_PRELOAD"]
    assert blas.preloaded(lib, env)


@pytest.mark.mlx
def test_the_fast_blas_gives_the_same_greedy_tokens(system_blas: Path, tiny_model_dir: Path) -> None:
    """Greedy generation on the tiny demo model gives the same tokens on OpenBLAS as on the reference BLAS."""
    reference = _greedy(tiny_model_dir, _without_preload())
    fast = _greedy(tiny_model_dir, blas.environment(blas.choose({}), _without_preload()))
    assert reference["fast"] is False
    assert fast["fast"] is True
    assert fast["tokens"] == reference["tokens"]
    assert len(reference["tokens"]) == 32  # type: ignore[arg-type]


def test_serve_reexecutes_itself_onto_the_fast_blas(system_blas: Path, tmp_path: Path) -> None:
    """`mlxd serve` started without LD_PRELOAD runs with the system's OpenBLAS mapped, and says so."""
    config = write_config(tmp_path / "models.yaml", {
        "manager": {"memory_budget_gb": 1},
        "models": [{"name": "f", "engine": "fake", "estimated_memory_gb": 0.1}],
    })
    with DaemonProcess(config, tmp_path, env={"LD_PRELOAD": "", "MLXD_BLAS": ""}) as d:
        assert d.proc is not None
        maps = Path(f"/proc/{d.proc.pid}/maps").read_text()
        assert str(system_blas) in maps
        assert "MLX's CPU backend runs on OpenBLAS" in d.log()


def test_serve_without_a_fast_blas_says_what_it_costs(tmp_path: Path) -> None:
    """With MLXD_BLAS naming a missing library, `mlxd serve` starts on the reference BLAS and warns once."""
    config = write_config(tmp_path / "models.yaml", {
        "manager": {"memory_budget_gb": 1},
        "models": [{"name": "f", "engine": "fake", "estimated_memory_gb": 0.1}],
    })
    env = {"LD_PRELOAD": "", "MLXD_BLAS": str(tmp_path / "missing-libblas.so")}
    with DaemonProcess(config, tmp_path, env=env) as d:
        assert d.proc is not None
        assert "openblas" not in Path(f"/proc/{d.proc.pid}/maps").read_text()
        log = d.log()
    assert log.count("prefill about 10x slower") == 1
    assert "missing-libblas.so" in log
