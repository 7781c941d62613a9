"""`mlxd demo-model`: write a random-weight model that mlx-lm (or mlx-vlm) loads."""

from __future__ import annotations

import argparse
import sys
import time

from mlxd.engines.model_files.demo_model import DemoKind, DemoModelError, write_demo_model


def cmd_demo_model(args: argparse.Namespace) -> int:
    """``mlxd demo-model PATH [--size tiny|small|large] [--vision] [--no-tools] [--force]``."""
    kind: DemoKind = "vision" if args.vision else "embedding" if getattr(args, "embedding", False) else args.size
    if args.vision and args.size not in (None, "tiny"):
        print(
            f"mlxd: --vision writes a tiny LLaVA; --size {args.size} is not available for it",
            file=sys.stderr,
        )
        return 2
    t0 = time.monotonic()

    def report(msg: str) -> None:
        print(f"demo-model: {msg} ({time.monotonic() - t0:.1f}s)", file=sys.stderr, flush=True)

    try:
        write_demo_model(
            args.path,
            kind,
            force=bool(getattr(args, "force", False)),
            report=report,
            tools=not getattr(args, "no_tools", False),
        )
    except DemoModelError as e:
        print(f"mlxd: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"mlxd: cannot write {args.path}: {e.strerror or e}", file=sys.stderr)
        return 1
    return 0
