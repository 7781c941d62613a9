"""The rules of a model's ``isolation`` and ``distributed:`` keys, and mlx.launch hostfiles.

``distributed:`` takes ``hosts:`` (names or addresses; the first is this
machine, where rank 0 runs) or ``hostfile:`` (the JSON file ``mlx.launch
--hostfile`` reads and ``mlx.distributed_config`` writes:
``{"backend", "envs", "hosts": [{"ssh", "ips", "rdma"}]}`` or the bare list
of hosts), plus ``backend`` (``ring`` | ``jaccl`` | ``mpi``), ``port`` and
``python``. A distributed model always runs in worker processes.
"""

from __future__ import annotations

import ipaddress
import json
from collections.abc import Callable
from pathlib import Path
from typing import Literal, cast

from mlxd.config.model import (
    BACKENDS,
    DEFAULT_ISOLATION,
    ISOLATIONS,
    DistributedHost,
    DistributedSettings,
)
from mlxd.config.readers import Table, join, show

DISTRIBUTED_KEYS = ("backend", "hosts", "hostfile", "port", "python")

Isolation = Literal["thread", "process"]


def isolation(t: Table, engine: str, distributed: bool) -> Isolation:
    """``isolation``: given, or ``process`` for a distributed model, or the default for the engine."""
    given = t.optional_string("isolation", choices=ISOLATIONS)
    if distributed:
        if given == "thread":
            raise t.error(
                "isolation", "a distributed model runs in worker processes (isolation: process)"
            )
        return "process"
    if given is not None:
        return cast(Isolation, given)
    return DEFAULT_ISOLATION if engine == "mlx" else "thread"


def distributed(
    t: Table, engine: str, mllm: bool, demo: str | None, local_path: Callable[[Table, str, str], Path]
) -> DistributedSettings | None:
    """``distributed:`` of one model (None when absent)."""
    if not t.has("distributed"):
        return None
    if engine != "mlx" or mllm:
        raise t.error("distributed", "only for text models of engine: mlx")
    if demo is not None:
        raise t.error(
            "distributed", "not with demo: every host needs the model's files at the same path"
        )
    d = t.table("distributed", DISTRIBUTED_KEYS)
    if d.has("hosts") == d.has("hostfile"):
        raise d.error("hosts", "give hosts: (a list) or hostfile: (a path), exactly one of them")
    backend: str | None = None
    envs: tuple[str, ...] = ()
    hostfile: Path | None = None
    if d.has("hostfile"):
        hostfile = local_path(d, "hostfile", d.string("hostfile", ""))
        backend, envs, hosts = read_hostfile(d, hostfile)
    else:
        hosts = _host_list(d)
    backend = d.string("backend", backend or "ring", choices=BACKENDS)
    if len(hosts) < 2:
        raise d.error("hosts", f"needs at least two hosts (got {len(hosts)})")
    port = d.optional_integer("port", minimum=1)
    if port is not None and port + 2 * len(hosts) > 65535:
        raise d.error("port", f"leaves no room for {len(hosts)} ranks below 65536 (got {port})")
    if backend == "mpi":
        raise d.error(
            "backend",
            "mpi is not supported yet: its ranks must be started by mpirun, which mlxd does not "
            "do; use ring (TCP or Thunderbolt) or jaccl",
        )
    if backend == "jaccl":
        _check_jaccl(d, hosts)
    return DistributedSettings(
        backend=cast(Literal["ring", "jaccl", "mpi"], backend),
        hosts=hosts,
        hostfile=hostfile,
        port=port,
        python=d.optional_string("python"),
        envs=envs,
    )


def _host_list(d: Table) -> tuple[DistributedHost, ...]:
    raw = d.raw["hosts"]
    if not isinstance(raw, list):
        raise d.error("hosts", f"must be a list of host names or addresses (got {show(raw)})")
    hosts = []
    for i, name in enumerate(raw):
        if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
            raise d.source.error(
                join(d.path("hosts"), i), f"must be a host name or address (got {show(name)})"
            )
        hosts.append(DistributedHost(ssh=name, ips=(name,) if _is_ip(name) else ()))
    return tuple(hosts)


def read_hostfile(
    d: Table, path: Path
) -> tuple[str | None, tuple[str, ...], tuple[DistributedHost, ...]]:
    """``(backend or None, envs, hosts)`` of an mlx.launch JSON hostfile."""
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise d.error("hostfile", f"cannot read '{path}': {e.strerror or e}") from None
    except ValueError as e:
        raise d.error("hostfile", f"'{path}' is not JSON: {e}") from None
    backend: str | None = None
    envs: tuple[str, ...] = ()
    if isinstance(data, dict):
        b, listed, data = data.get("backend"), data.get("envs", []), data.get("hosts")
        if b not in (None, "", *BACKENDS):
            raise d.error("hostfile", f"'{path}': backend must be one of {', '.join(BACKENDS)}")
        backend = b or None
        if not (isinstance(listed, list) and all(isinstance(x, str) and "=" in x for x in listed)):
            raise d.error("hostfile", f"'{path}': envs must be a list of NAME=value strings")
        envs = tuple(listed)
    if not isinstance(data, list):
        raise d.error("hostfile", f"'{path}': expected a list of hosts")
    hosts = []
    for i, h in enumerate(data):
        ok = isinstance(h, dict) and isinstance(h.get("ssh"), str) and h["ssh"].strip()
        ips = h.get("ips", []) if isinstance(h, dict) else None
        rdma = h.get("rdma", []) if isinstance(h, dict) else None
        if not ok or not isinstance(ips, list) or not isinstance(rdma, list):
            raise d.error(
                "hostfile", f"'{path}': host {i} must be {{\"ssh\": name, \"ips\": [...], \"rdma\": [...]}}"
            )
        if not all(isinstance(ip, str) and _is_ip(ip) for ip in ips):
            raise d.error("hostfile", f"'{path}': host {i}: ips must be IP addresses")
        devices = tuple(r if (r is None or isinstance(r, str)) else ",".join(map(str, r)) for r in rdma)
        hosts.append(DistributedHost(ssh=h["ssh"], ips=tuple(ips), rdma=devices))
    return backend, envs, tuple(hosts)


def _check_jaccl(d: Table, hosts: tuple[DistributedHost, ...]) -> None:
    n = len(hosts)
    if not hosts[0].ips:
        raise d.error("hosts", "jaccl: the first host needs an IP that every rank can reach")
    for i, h in enumerate(hosts):
        if len(h.rdma) != n or h.rdma[i] is not None:
            raise d.error(
                "hostfile",
                f"jaccl: host {i} must list {n} RDMA devices, null towards itself "
                "(write the hostfile with mlx.distributed_config)",
            )


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True
