"""The ``isolation`` and ``distributed:`` keys of a model, and mlx.launch hostfiles."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from mlxd.config import parse_config
from mlxd.config.model import DEFAULT_ISOLATION, DistributedHost
from mlxd.errors import ConfigError


def model_dir(tmp_path: Path, size: int = 1000) -> Path:
    d = tmp_path / "m"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text("{}")
    (d / "model.safetensors").write_bytes(b"\0" * size)
    return d


def parse(tmp_path: Path, **model: Any) -> Any:
    raw = {"manager": {"memory_budget_gb": 1}, "models": [{"name": "m", **model}]}
    return parse_config(raw, path=tmp_path / "models.yaml").models[0]


def test_isolation_defaults_by_engine_and_can_be_set(tmp_path: Path) -> None:
    d = str(model_dir(tmp_path))
    assert parse(tmp_path, path=d).isolation == DEFAULT_ISOLATION
    assert parse(tmp_path, engine="fake", estimated_memory_gb=1).isolation == "thread"
    assert parse(tmp_path, path=d, isolation="process").isolation == "process"
    assert parse(tmp_path, engine="fake", estimated_memory_gb=1, isolation="process").isolation == "process"
    with pytest.raises(ConfigError, match=r"models\[0\].isolation: must be one of thread, process"):
        parse(tmp_path, path=d, isolation="fork")


def test_distributed_hosts_run_in_processes_and_count_this_hosts_share(tmp_path: Path) -> None:
    d = str(model_dir(tmp_path, 1001))
    m = parse(tmp_path, path=d, distributed={"hosts": ["127.0.0.1", "mac-b.local"], "port": 40000})
    assert m.isolation == "process"
    dist = m.distributed
    assert dist.backend == "ring" and dist.size == 2 and dist.port == 40000
    assert dist.hosts == (DistributedHost("127.0.0.1", ("127.0.0.1",)), DistributedHost("mac-b.local"))
    cfg = parse_config(
        {"manager": {"memory_budget_gb": 1}, "models": [{"name": "m", "path": d, "distributed": {"hosts": ["a", "b"]}}]}
    )
    assert cfg.estimate("m").bytes == 501  # half of the weights, rounded up


def test_a_hostfile_in_mlx_launch_format(tmp_path: Path) -> None:
    d = str(model_dir(tmp_path))
    hostfile = tmp_path / "hosts.json"
    hostfile.write_text(json.dumps({
        "backend": "jaccl",
        "envs": ["MLX_METAL_FAST_SYNCH=1"],
        "hosts": [
            {"ssh": "mac-a", "ips": ["10.0.0.1"], "rdma": [None, "rdma_en3"]},
            {"ssh": "mac-b", "ips": ["10.0.0.2"], "rdma": ["rdma_en3", None]},
        ],
    }))
    m = parse(tmp_path, path=d, distributed={"hostfile": "hosts.json"})
    dist = m.distributed
    assert dist.backend == "jaccl" and dist.envs == ("MLX_METAL_FAST_SYNCH=1",)
    assert dist.hostfile == hostfile
    assert dist.hosts[1] == DistributedHost("mac-b", ("10.0.0.2",), ("rdma_en3", None))
    # a bare list is a hostfile too; the config's backend wins over the file's
    hostfile.write_text(json.dumps([{"ssh": "a", "ips": ["10.0.0.1"]}, {"ssh": "b", "ips": ["10.0.0.2"]}]))
    assert parse(tmp_path, path=d, distributed={"hostfile": str(hostfile)}).distributed.backend == "ring"


@pytest.mark.parametrize(
    ("model", "where", "fragment"),
    [
        ({"distributed": {"hosts": ["a"]}}, "distributed.hosts", "at least two hosts"),
        ({"distributed": {"hosts": ["a", "b"], "hostfile": "x"}}, "distributed.hosts", "exactly one"),
        ({"distributed": {}}, "distributed", "only for"),
        ({"distributed": {"hosts": "a,b"}}, "distributed.hosts", "must be a list"),
        ({"distributed": {"hosts": ["a", "b c"]}}, "distributed.hosts[1]", "host name or address"),
        ({"distributed": {"hosts": ["a", "b"], "backend": "nccl"}}, "distributed.backend", "one of ring, jaccl, mpi"),
        ({"distributed": {"hosts": ["a", "b"], "hots": 1}}, "distributed.hots", "unknown key"),
        ({"distributed": {"hostfile": "missing.json"}}, "distributed.hostfile", "cannot read"),
        ({"distributed": {"hosts": ["a", "b"]}, "isolation": "thread"}, "isolation", "worker processes"),
        ({"distributed": {"hosts": ["10.0.0.1", "b"], "backend": "jaccl"}}, "distributed.hostfile", "RDMA"),
        ({"distributed": {"hosts": ["a", "b"], "port": 65535}}, "distributed.port", "no room"),
        ({"distributed": {"hosts": ["a", "b"], "backend": "mpi"}}, "distributed.backend", "not supported yet"),
    ],
)
def test_bad_distributed_settings_name_their_key(
    tmp_path: Path, model: dict[str, Any], where: str, fragment: str
) -> None:
    d = str(model_dir(tmp_path))
    if model["distributed"] == {}:
        model = {"engine": "fake", "estimated_memory_gb": 1, "distributed": {"hosts": ["a", "b"]}}
        d = None  # type: ignore[assignment]
    kw = {"path": d} if d else {}
    with pytest.raises(ConfigError) as exc:
        parse(tmp_path, **kw, **model)
    assert exc.value.message.startswith(f"models[0].{where}:"), exc.value.message
    assert fragment in exc.value.message
