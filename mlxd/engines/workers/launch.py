"""How the worker processes of one residency are started: one, or one per rank.

A model on one machine has one worker: this interpreter running
:mod:`mlxd.engines.workers.worker`. A ``distributed:`` model has one worker per rank,
started the way ``mlx.launch`` starts them (``mlx/_distributed_utils/launch.py``
in mlx 0.32): every rank gets ``MLX_RANK`` and the backend's variables
(``ring``: ``MLX_HOSTFILE``, a JSON list of each rank's ``ip:port``s;
``jaccl``: ``MLX_JACCL_COORDINATOR`` and ``MLX_IBV_DEVICES``), plus the
hostfile's ``envs``. Rank 0 always runs here (the daemon talks to it; its
memory is this host's share of the model). Another rank whose host is this
machine (``127.0.0.1``, ``localhost``, ``::1``) is a plain child process too;
any other host is reached with ``ssh -o BatchMode=yes HOST SCRIPT`` (the
command is ``$MLXD_SSH`` if set), where the script exports the variables,
writes the files with ``mktemp`` and ``exec``\\ s the worker, so that the
ssh session's stdin and stdout are the worker's: the daemon's frames travel
through ssh unchanged, and the end of the session is the end of the rank.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from mlxd.config import ModelConfig
from mlxd.config.model import DistributedHost, DistributedSettings
from mlxd.engines.workers import worker
from mlxd.engines.workers.wire import Rank
from mlxd.errors import LoadFailed

LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})
#: mlx.launch's default first port
DEFAULT_PORT = 32323
SSH_ENV = "MLXD_SSH"


@dataclass(frozen=True)
class RankLaunch:
    """How to start one worker."""

    rank: Rank | None
    argv: list[str]
    #: the whole environment of a local worker (None: this process's); unused over ssh
    env: dict[str, str] | None = None
    #: where it runs, for messages ("local" or the ssh destination)
    where: str = "local"
    #: files made for this launch, removed when the residency ends
    files: list[Path] = field(default_factory=list)


def plan(model: ModelConfig) -> list[RankLaunch]:
    """The workers of one residency of ``model``. Blocking (name lookups); raises LoadFailed."""
    dist = model.distributed
    if dist is None:
        return [RankLaunch(None, worker.command(warm=model.engine == "mlx"))]
    n = dist.size
    tmp = Path(tempfile.mkdtemp(prefix=f"mlxd-{_safe(model.name)}-"))
    files: dict[str, str] = {}
    env = [*dist.envs]
    if dist.backend == "ring":
        files["MLX_HOSTFILE"] = json.dumps(_ring_addresses(dist))
    else:  # jaccl (the config refuses mpi: its ranks must be started by mpirun)
        env.append(f"MLX_JACCL_COORDINATOR={dist.hosts[0].ips[0]}:{dist.port or DEFAULT_PORT}")
        files["MLX_IBV_DEVICES"] = json.dumps([list(h.rdma) for h in dist.hosts])
    local_files = []
    for name, content in files.items():
        path = tmp / f"{name.lower()}.json"
        path.write_text(content)
        local_files.append(path)
    launches = []
    for r, host in enumerate(dist.hosts):
        rank = Rank(r, n, dist.backend)
        variables = [*env, f"MLX_RANK={r}"]
        if r == 0 or host.ssh in LOCAL_HOSTS:
            full = dict(os.environ)
            full.update(dict(v.split("=", 1) for v in variables))
            full.update({name: str(tmp / f"{name.lower()}.json") for name in files})
            launches.append(RankLaunch(rank, worker.command(), full, "local", local_files))
        else:
            script = remote_script(variables, files, dist.python or sys.executable)
            ssh = shlex.split(os.environ.get(SSH_ENV, "ssh"))
            argv = [*ssh, "-o", "BatchMode=yes", "-o", "ServerAliveInterval=5", host.ssh, script]
            launches.append(RankLaunch(rank, argv, None, host.ssh, local_files))
    return launches


def remote_script(variables: list[str], files: dict[str, str], python: str) -> str:
    """The bash script an ssh session runs: variables, files, then ``exec`` the worker."""
    parts = []
    for v in variables:
        key, value = v.split("=", 1)
        parts.append(f"export {key}={shlex.quote(value)}")
    for name, content in files.items():
        parts.append(f"f=$(mktemp) && printf '%s' {shlex.quote(content)} > \"$f\" && export {name}=\"$f\"")
    argv = worker.command()
    argv[0] = python
    parts.append("exec " + shlex.join(argv))
    return "; ".join(parts)


def _ring_addresses(dist: DistributedSettings) -> list[list[str]]:
    """Each rank's ``ip:port`` list, as mlx.launch numbers them (one port per rank and IP)."""
    ips = [_addresses(h) for h in dist.hosts]
    if dist.port is None and all(h.ssh in LOCAL_HOSTS for h in dist.hosts[1:]) and all(
        ip in LOCAL_HOSTS for group in ips for ip in group
    ):
        return [[f"{ip}:{free_port(ip)}" for ip in group] for group in ips]
    port = dist.port or DEFAULT_PORT
    out = []
    for group in ips:
        out.append([f"{ip}:{port + i}" for i, ip in enumerate(group)])
        port += len(group)
    return out


def _addresses(host: DistributedHost) -> list[str]:
    if host.ips:
        return list(host.ips)
    try:
        return [str(socket.getaddrinfo(host.ssh, None, socket.AF_INET)[0][4][0])]
    except OSError as e:
        raise LoadFailed(f"cannot resolve the address of host '{host.ssh}': {e}") from e


def free_port(ip: str) -> int:
    """A TCP port free on ``ip`` now (for ranks that all run on this machine)."""
    family = socket.AF_INET6 if ":" in ip else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.bind((ip, 0))
        return int(s.getsockname()[1])


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
