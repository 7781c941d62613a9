"""The ``mlxd`` command line.

Exit codes: 0 ok, 1 runtime failure, 2 usage or config error, 3 daemon unreachable.
Errors are printed on stderr as one line, never as a traceback.

Every ``argparse`` command and its printing lives in this package, one module
per command family (:mod:`.serve`, :mod:`.client` and :mod:`.events` for the commands
that talk to a running daemon, :mod:`.render` for how their replies read, :mod:`.plan`, :mod:`.history`, :mod:`.migrate`, :mod:`.check_config`,
:mod:`.demo_model`, :mod:`.service_files`, :mod:`.route` for the fleet); this module only parses arguments
and dispatches (handlers are imported lazily so ``mlxd --help`` is instant).
The CLI is the top layer: it may import anything; nothing imports it.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from mlxd import __version__
from mlxd.cli.common import EXIT_FAILURE, EXIT_OK, EXIT_UNREACHABLE, EXIT_USAGE, DaemonUnreachable
from mlxd.residency.policy import STRATEGIES

__all__ = ["EXIT_FAILURE", "EXIT_OK", "EXIT_UNREACHABLE", "EXIT_USAGE", "DaemonUnreachable", "main"]


def _add_url(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--url",
        help="daemon base URL (default: from --config, else $MLXD_URL, else http://127.0.0.1:8080)",
    )
    p.add_argument("--config", help="config file to read the daemon's host and port from")
    p.add_argument(
        "--api-key",
        help="API key (default: the value of the config's api_key_env variable, MLXD_API_KEY)",
    )
    p.add_argument("--timeout", type=float, default=600.0, help="seconds to wait for the reply")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="mlxd",
        description="mlxd: a local MLX model server with journaled residency management.",
    )
    parser.add_argument("--version", action="version", version=f"mlxd {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    _add_serve(sub)
    _add_daemon_commands(sub)
    _add_file_commands(sub)
    return parser



def _add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("serve", help="run the daemon (the built-in offline demo without --config)")
    p.add_argument("--config", help="YAML config (default: the built-in offline demo config)")
    p.add_argument("--host", help="bind address (overrides server.host)")
    p.add_argument("--port", type=int, help="port, 0 for any free port (overrides server.port)")
    p.add_argument(
        "--ollama-port",
        type=int,
        help="also serve on this port (Ollama's is 11434) for clients that hard-code it "
        "(overrides server.ollama_port)",
    )
    p.add_argument("--journal", help="journal file (overrides journal.path)")
    p.add_argument(
        "--log-level",
        default="info",
        choices=["debug", "info", "warning", "error"],
        help="log verbosity (default: info)",
    )
    p.add_argument(
        "--log-format",
        default="logfmt",
        choices=["logfmt", "json"],
        help="format of the access log, one line per request (default: logfmt)",
    )
    p.add_argument(
        "--access-log",
        default="-",
        metavar="FILE",
        help="write the access log to FILE, reopened when rotated (default: - for stdout)",
    )
    p.add_argument(
        "--insecure",
        action="store_true",
        help="allow binding a non-loopback address without an API key",
    )
    p.add_argument(
        "--ready-file",
        help="write the bound URL to this file once the daemon is ready (for supervisors)",
    )
    p.set_defaults(handler="mlxd.cli.serve:cmd_serve")

    p = sub.add_parser("check-config", help="validate a config and print the memory budget report")
    p.add_argument("path", help="YAML config to check")
    p.add_argument("--allow-unfit", action="store_true",
                   help="a model larger than the whole budget is a warning, not an error")
    p.set_defaults(handler="mlxd.cli.check_config:cmd_check_config")


def _add_daemon_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Commands that talk to a running daemon over HTTP."""
    p = sub.add_parser("status", help="show the running daemon's residency status")
    _add_url(p)
    p.add_argument("--json", action="store_true", help="print the raw JSON status")
    p.add_argument("--fleet", metavar="FLEET_YAML",
                   help="show every daemon of this fleet file side by side (see `mlxd route`)")
    p.set_defaults(handler="mlxd.cli.client:cmd_status")

    p = sub.add_parser(
        "route",
        help="run LiteLLM's proxy with mlxd's residency-aware strategy in front of several daemons",
        description="Start LiteLLM's proxy server (the mlxd[fleet] extra) with one deployment per "
        "daemon and model of the fleet file, routed by residency: a request goes to a daemon "
        "where its model is loaded and least queued, else where loading it evicts the least.",
    )
    p.add_argument("--config", required=True, metavar="FLEET_YAML",
                   help="fleet file: proxy settings and the daemons (url, api_key_env, models)")
    p.add_argument("--check", action="store_true",
                   help="start nothing: print which daemon has what and where requests would go")
    p.add_argument("--host", help="proxy bind address (default: proxy.host, 127.0.0.1)")
    p.add_argument("--port", type=int, help="proxy port (default: proxy.port, 4000)")
    p.add_argument("--strategy", choices=["mlxd", "simple-shuffle", "least-busy"], default="mlxd",
                   help="routing strategy (default: mlxd; LiteLLM's own ones for comparison)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"],
                   help="the proxy's log verbosity (default: warning)")
    p.set_defaults(handler="mlxd.cli.route:cmd_route")

    p = sub.add_parser("load", help="ask the running daemon to load a model")
    p.add_argument("name", help="model name")
    _add_url(p)
    p.set_defaults(handler="mlxd.cli.client:cmd_load")

    p = sub.add_parser("unload", help="ask the running daemon to unload a model")
    p.add_argument("name", help="model name")
    p.add_argument(
        "--preempt", action="store_true", help="preempt live requests instead of letting them finish"
    )
    _add_url(p)
    p.set_defaults(handler="mlxd.cli.client:cmd_unload")

    p = sub.add_parser("plan", help="what loading a model now would do, and why (changes nothing)")
    p.add_argument("name", help="model name")
    p.add_argument("--json", action="store_true", help="print the raw JSON plan")
    p.add_argument(
        "--contention",
        choices=STRATEGIES,
        help="plan for a request sent with this X-Mlxd-Contention header",
    )
    p.add_argument(
        "--tokens",
        type=int,
        help="plan for a request of this many tokens (prompt + max_tokens): its KV is reserved too",
    )
    _add_url(p)
    p.set_defaults(handler="mlxd.cli.plan:cmd_plan")

    p = sub.add_parser("events", help="follow the daemon's residency and lease events")
    _add_url(p)
    p.add_argument("--json", action="store_true", help="print each event as one JSON line")
    p.add_argument("--last-event-id", help="resume after this event id")
    p.set_defaults(handler="mlxd.cli.events:cmd_events")


def _add_file_commands(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    """Commands that read or write files; the daemon may be down."""
    p = sub.add_parser("history", help="print journal rows (reads the file; the daemon may be down)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--journal", help="journal file")
    g.add_argument("--config", help="config whose journal.path to read")
    p.add_argument("--model", help="only this model")
    p.add_argument("--since", help="ISO time (2026-11-29T10:00) or a duration ago (90s, 15m, 2h, 7d)")
    p.add_argument("--limit", type=int, default=50, help="at most this many rows (default 50)")
    p.add_argument("--leases", action="store_true", help="show leases instead of transitions")
    p.add_argument("--client", help="only the leases of this API key name (implies --leases)")
    p.add_argument(
        "--checkpoints", action="store_true",
        help="show where each pruned model's kept history starts (journal retention)",
    )
    p.add_argument("--json", action="store_true", help="print a JSON array with the journal's columns")
    p.add_argument("--verify", action="store_true",
                   help="check the whole journal (integrity, legal paths, open leases); exit 1 on a problem")
    p.set_defaults(handler="mlxd.cli.history:cmd_history")

    p = sub.add_parser("demo-model", help="write a random-weight model that mlx-lm loads")
    p.add_argument("path", help="directory to write")
    p.add_argument("--size", choices=["tiny", "small", "large"], default="tiny",
                   help="tiny (tests), small (~25M params) or large (735M params, 2.7 GiB on disk, "
                   "under a minute to write: the agents bench's largest)")
    p.add_argument("--vision", action="store_true", help="write a tiny LLaVA for mlx-vlm instead")
    p.add_argument("--embedding", action="store_true",
                   help="write a tiny BERT for mlx-embeddings (an embedding: true model) instead")
    p.add_argument("--no-tools", action="store_true",
                   help="a chat template without tool support (tools then get a 400)")
    p.add_argument("--force", action="store_true", help="overwrite an existing model")
    p.set_defaults(handler="mlxd.cli.demo_model:cmd_demo_model")

    p = sub.add_parser("migrate", help="apply journal migrations (or show their status)")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--journal", help="journal file")
    g.add_argument("--config", help="config whose journal.path to use")
    p.add_argument("--status", action="store_true", help="only show the version; never writes")
    p.set_defaults(handler="mlxd.cli.migrate:cmd_migrate")

    p = sub.add_parser("launchd-plist", help="print a launchd plist for this install")
    p.add_argument("--config", help="config file the daemon should use")
    p.add_argument("--label", default="com.mlxd.daemon", help="launchd label")
    p.set_defaults(handler="mlxd.cli.service_files:cmd_launchd_plist")


def main(argv: Sequence[str] | None = None) -> int:
    # mlxd runs models on MLX, never on PyTorch: transformers' import-time advice that
    # "PyTorch was not found" is noise to its users (it printed on `demo-model --embedding`)
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    parser = build_parser()
    args = parser.parse_args(argv)
    if argv is None and args.command == "serve":
        # From the command line only (a test calling main() in-process keeps its process):
        # re-execute once with a fast BLAS preloaded when the system has one (mlxd.blas).
        from mlxd.blas import reexec_with_fast_blas

        reexec_with_fast_blas(sys.argv[1:])
    if not getattr(args, "handler", None):
        parser.print_help()
        return EXIT_USAGE
    module_name, func_name = args.handler.split(":")
    from mlxd.errors import ConfigError, MlxdError

    try:
        handler = getattr(importlib.import_module(module_name), func_name)
        return int(handler(args) or 0)
    except ConfigError as e:  # one line per error (check-config reports them all)
        for line in e.message.splitlines():
            print(f"mlxd: {line}", file=sys.stderr)
        return EXIT_USAGE
    except DaemonUnreachable as e:
        print(f"mlxd: daemon unreachable: {e}", file=sys.stderr)
        return EXIT_UNREACHABLE
    except MlxdError as e:
        print(f"mlxd: {e.message}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:
        return EXIT_OK


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
