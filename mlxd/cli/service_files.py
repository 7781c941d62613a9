"""``mlxd launchd-plist``: a launchd job for this install, so mlxd runs at login on macOS.

The plist is built as a dict and written with :mod:`plistlib` (valid XML by
construction); explanatory XML comments are then put before the keys they
explain (``plistlib`` and ``launchd`` both ignore comments). The install and
removal commands go to stderr, so ``mlxd launchd-plist > FILE`` writes only the
plist. ``systemd-like-plists/com.mlxd.daemon.plist`` is the same job with
placeholder paths, and ``systemd-like-plists/mlxd.service`` its systemd twin.

Choices the comments in the plist explain:

- ``ExitTimeOut`` = ``server.shutdown_grace_s`` + :data:`EXIT_MARGIN_S`: launchd
  sends SIGTERM, then SIGKILL once ``ExitTimeOut`` passes. mlxd gives running
  streams the grace, then unloads the models, stops HTTP and commits the run's
  clean stop to the journal; killed before that, the next start runs crash recovery.
- ``ProcessType`` ``Interactive``: ``Background`` jobs are throttled (CPU and
  I/O priority, efficiency cores only on Apple silicon), which would slow model
  loads and token generation that a user is waiting for.
- ``SoftResourceLimits.NumberOfFiles``: launchd's default soft limit is 256;
  HTTP connections, event followers, the journal's three files and weight
  files each take one.
"""

from __future__ import annotations

import argparse
import math
import plistlib
import sys
from pathlib import Path
from typing import Any

from mlxd.config import ServerConfig, load_config

DEFAULT_LABEL = "com.mlxd.daemon"
#: seconds launchd waits beyond the shutdown grace before SIGKILL (see the module doc)
EXIT_MARGIN_S = 10.0
NUMBER_OF_FILES = 4096
PROCESS_TYPE = "Interactive"

#: XML comments put before a key; the path is the nesting of keys (top level: one key)
COMMENTS: dict[tuple[str, ...], str] = {
    ("Label",): "mlxd launchd job. Install: launchctl bootstrap gui/UID THIS_FILE; "
    "remove: launchctl bootout gui/UID/LABEL (UID is the output of: id -u).",
    ("ProgramArguments",): "This install's mlxd (from its virtualenv). Generate the plist again "
    "with 'mlxd launchd-plist' after moving or recreating the virtualenv. The access log (a "
    "line per request) goes to its own file, which mlxd reopens when newsyslog rotates it.",
    ("RunAtLoad",): "Start when the job is bootstrapped and at every login.",
    ("KeepAlive",): "Restart mlxd whenever it exits (launchd waits at least 10 s between starts). "
    "To stop it for good use launchctl bootout: a killed job is started again.",
    ("ExitTimeOut",): "Seconds between SIGTERM and SIGKILL: the shutdown grace "
    "(server.shutdown_grace_s, during which running streams finish) plus a margin to unload "
    "the models, stop HTTP and journal a clean stop. Killed earlier, the next start runs "
    "crash recovery.",
    ("ProcessType",): "Interactive, not Background: launchd throttles Background jobs (CPU and "
    "I/O priority, efficiency cores only), which would slow the loads and token generation "
    "a user is waiting for.",
    ("SoftResourceLimits",): "launchd's default is 256 open files; each HTTP connection, event "
    "follower, journal file (db, wal, shm) and open weight file takes one.",
    ("StandardOutPath",): "Logs. launchd does not create the folder: mkdir -p ~/Library/Logs/mlxd",
    ("WorkingDirectory",): "Relative paths in the config resolve against the config's folder, "
    "not this one.",
    ("EnvironmentVariables", "PYTHONUNBUFFERED"): "Write log lines out at once.",
}


def api_key_comment(env_name: str) -> str:
    return (
        f"{env_name}: set a key here to require 'Authorization: Bearer KEY' on /v1 and /admin "
        "(clients read the same variable, or take the api-key option). Empty means no key, "
        "which mlxd allows on a loopback address only. Once it holds a key, make this file "
        "private: chmod 600 FILE."
    )


def access_log_path(home: Path) -> Path:
    """Where the launchd job writes the access log (Console.app lists ~/Library/Logs)."""
    return home / "Library" / "Logs" / "mlxd" / "access.log"


def program_arguments(config: Path | None, home: Path) -> list[str]:
    """This interpreter's ``mlxd`` console script (else ``python -m mlxd``) with ``serve``."""
    python = Path(sys.executable)  # not resolved: a virtualenv's python is a symlink to keep
    script = python.parent / "mlxd"
    head = [str(script)] if script.is_file() else [str(python), "-m", "mlxd"]
    tail = ["--config", str(config)] if config is not None else []
    return [*head, "serve", "--access-log", str(access_log_path(home)), *tail]


def plist_dict(
    *,
    label: str,
    program: list[str],
    home: Path,
    grace_s: float,
    api_key_env: str,
) -> dict[str, Any]:
    """The launchd job as a dict, in the order the keys are written."""
    logs = home / "Library" / "Logs" / "mlxd"
    return {
        "Label": label,
        "ProgramArguments": program,
        "RunAtLoad": True,
        "KeepAlive": True,
        "ExitTimeOut": math.ceil(grace_s + EXIT_MARGIN_S),
        "ProcessType": PROCESS_TYPE,
        "SoftResourceLimits": {"NumberOfFiles": NUMBER_OF_FILES},
        "StandardOutPath": str(logs / "mlxd.out.log"),
        "StandardErrorPath": str(logs / "mlxd.err.log"),
        "WorkingDirectory": str(home),
        "EnvironmentVariables": {api_key_env: "", "PYTHONUNBUFFERED": "1"},
    }


def _comment(text: str, indent: int) -> str:
    if "--" in text or text.endswith("-"):
        raise ValueError(f"not allowed in an XML comment: {text!r}")
    return "\t" * indent + f"<!-- {text} -->\n"


def render_plist(job: dict[str, Any]) -> str:
    """``job`` as plist XML with :data:`COMMENTS` before the keys they explain."""
    text = plistlib.dumps(job, sort_keys=False).decode()
    env = job.get("EnvironmentVariables", {})
    comments = dict(COMMENTS)
    for name in env:
        if name != "PYTHONUNBUFFERED":
            comments[("EnvironmentVariables", name)] = api_key_comment(name)
    lines = text.splitlines(keepends=True)
    out: list[str] = []
    parents: list[str] = []  # keys of the dicts we are in (plistlib indents one tab per level)
    last_key: str | None = None
    for line in lines:
        stripped = line.strip()
        depth = len(line) - len(line.lstrip("\t"))
        if stripped.startswith("<key>"):
            key = stripped.removeprefix("<key>").removesuffix("</key>")
            del parents[depth - 1:]
            path = (*parents, key)
            if path in comments:
                out.append(_comment(comments[path], depth))
            last_key = key
        elif stripped == "<dict>" and last_key is not None and depth >= 1:
            parents[depth - 1:] = [last_key]
        out.append(line)
    return "".join(out)


def install_help(label: str, config: Path | None) -> str:
    """The commands that install and remove the job, for stderr."""
    plist = f"~/Library/LaunchAgents/{label}.plist"
    gen = "mlxd launchd-plist" + (f" --config {config}" if config else "")
    if label != DEFAULT_LABEL:
        gen += f" --label {label}"
    lines = [
        "# Install (runs mlxd now and at every login):",
        "mkdir -p ~/Library/LaunchAgents ~/Library/Logs/mlxd",
        f"{gen} > {plist}",
        f"launchctl bootstrap gui/$(id -u) {plist}",
        "# Check:",
        f"launchctl print gui/$(id -u)/{label} | head -20",
        "mlxd status" + (f" --config {config}" if config else ""),
        "# Restart after changing the config or upgrading mlxd (KeepAlive starts it again):",
        f"launchctl kill SIGTERM gui/$(id -u)/{label}",
        "# After changing the plist: bootout, then bootstrap again.",
        "# Stop and remove:",
        f"launchctl bootout gui/$(id -u)/{label}",
        f"rm {plist}",
    ]
    if sys.platform != "darwin":
        lines.append("# (launchd is macOS only; on Linux use systemd-like-plists/mlxd.service)")
    return "\n".join(lines)


def cmd_launchd_plist(args: argparse.Namespace) -> int:
    """Print the plist on stdout and how to install it on stderr."""
    config: Path | None = None
    server = ServerConfig()
    if args.config:
        config = Path(args.config).expanduser().absolute()
        server = load_config(config).server  # a broken config exits 2 here, not under launchd
    job = plist_dict(
        label=args.label,
        program=program_arguments(config, Path.home()),
        home=Path.home(),
        grace_s=server.shutdown_grace_s,
        api_key_env=server.api_key_env,
    )
    sys.stdout.write(render_plist(job))
    sys.stdout.flush()
    print(install_help(args.label, config), file=sys.stderr)
    return 0
