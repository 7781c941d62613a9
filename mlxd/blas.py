"""A fast BLAS for MLX's CPU backend on Linux.

MLX's Linux CPU wheel (``mlx[cpu]``) links netlib's reference BLAS, which runs
a 512x1024x1024 fp32 matmul at ~6 GFLOP/s where OpenBLAS runs it at ~325 on the
same 2-core box: a 1,774-token prefill of the small demo model takes 24.7 s on
the reference BLAS and 2.3 s on OpenBLAS (docs/platform-facts.md).
MLX calls the standard ``cblas_*``/``sgemm_`` symbols, so a BLAS preloaded into
the process (``LD_PRELOAD``) answers them first. The loader reads ``LD_PRELOAD``
only when a process starts, so ``mlxd serve`` re-executes itself once with the
variable set (:func:`reexec_with_fast_blas`) before anything imports MLX; its
children (engine worker processes) inherit it.

Which BLAS: ``$MLXD_BLAS`` if set (a library path, or ``off`` to keep the
reference BLAS), else the first that exists of Debian's OpenBLAS builds
(``libopenblas0-pthread``: ``/usr/lib/<triplet>/openblas-pthread/libblas.so.3``).
macOS is left alone: MLX runs on Metal and Accelerate there.

This module imports nothing of mlxd and nothing heavy: it runs before the rest.
"""

from __future__ import annotations

import os
import platform
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

#: set by mlxd itself on the re-executed process, so it never re-executes twice
REEXEC_MARK = "MLXD_BLAS_REEXEC"
#: the user's choice: a library path, or "off"
CHOICE_ENV = "MLXD_BLAS"
#: Debian's package that provides the library, named in the start-up hint
DEBIAN_PACKAGE = "libopenblas0-pthread"

_TRIPLETS = ("x86_64-linux-gnu", "aarch64-linux-gnu")


def _candidates() -> list[Path]:
    return [Path(f"/usr/lib/{t}/openblas-pthread/libblas.so.3") for t in _TRIPLETS] + [
        Path(f"/usr/lib/{t}/libopenblas.so.0") for t in _TRIPLETS
    ]


@dataclass(frozen=True, slots=True)
class BlasChoice:
    """What MLX's CPU backend will run on in a process started with ``env``."""

    #: the library to preload, or None (reference BLAS, or not Linux)
    library: Path | None
    #: one sentence for the start-up log
    summary: str
    #: True when a fast BLAS could be had but is not in use (the start-up log warns)
    missing: bool = False


def choose(env: Mapping[str, str] | None = None, *, system: str | None = None) -> BlasChoice:
    """The BLAS a process started with ``env`` should preload, and why."""
    env = os.environ if env is None else env
    system = system or platform.system()
    if system != "Linux":
        return BlasChoice(None, "MLX runs on the platform's own BLAS")
    wanted = env.get(CHOICE_ENV, "").strip()
    if wanted.lower() == "off":
        return BlasChoice(None, f"MLX's CPU backend uses its reference BLAS ({CHOICE_ENV}=off)")
    if wanted:
        path = Path(wanted).expanduser()
        if not path.is_file():
            return BlasChoice(
                None,
                f"{CHOICE_ENV}={wanted}: no such file; MLX's CPU backend uses its reference BLAS "
                "(prefill about 10x slower)",
                missing=True,
            )
        return BlasChoice(path, f"MLX's CPU backend runs on {path} ({CHOICE_ENV})")
    for path in _candidates():
        if path.is_file():
            return BlasChoice(path, f"MLX's CPU backend runs on OpenBLAS ({path})")
    return BlasChoice(
        None,
        "MLX's CPU backend uses its reference BLAS: prompts prefill about 10x slower than on "
        f"OpenBLAS; install Debian's {DEBIAN_PACKAGE} (apt-get install {DEBIAN_PACKAGE}) "
        "and restart",
        missing=True,
    )


def preloaded(library: Path, env: Mapping[str, str] | None = None) -> bool:
    """Whether ``LD_PRELOAD`` in ``env`` already names ``library``."""
    env = os.environ if env is None else env
    entries = env.get("LD_PRELOAD", "").replace(":", " ").split()
    return str(library) in entries


def environment(choice: BlasChoice, env: Mapping[str, str] | None = None) -> dict[str, str]:
    """``env`` with ``choice``'s library first in ``LD_PRELOAD`` (for a child process)."""
    out = dict(os.environ if env is None else env)
    if choice.library is not None and not preloaded(choice.library, out):
        rest = out.get("LD_PRELOAD", "")
        out["LD_PRELOAD"] = f"{choice.library} {rest}".strip()
    return out


def reexec_with_fast_blas(argv: Sequence[str]) -> None:
    """Re-execute this Python process with the fast BLAS preloaded, if it needs to be.

    Returns when nothing is to be done (not Linux, no fast BLAS, already preloaded,
    or already re-executed once); otherwise it does not return. ``argv`` are the
    arguments after the program name (``["serve", "--port", "0"]``).
    """
    choice = choose()
    if choice.library is None or preloaded(choice.library) or os.environ.get(REEXEC_MARK):
        return
    env = environment(choice)
    env[REEXEC_MARK] = "1"
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "mlxd", *argv], env)


def in_use(library: Path) -> bool:
    """Whether ``library`` is mapped into this process (read from ``/proc/self/maps``)."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    names = {str(library), str(library.resolve())}
    return any(line.rsplit(" ", 1)[-1] in names for line in maps.splitlines())


def startup_report() -> tuple[bool, str]:
    """``(is_a_warning, sentence)``: what MLX's CPU backend runs on in this process."""
    choice = choose()
    if choice.library is not None and not in_use(choice.library):
        return True, (
            f"{choice.library} is there but not preloaded in this process: MLX's CPU backend "
            "uses its reference BLAS (prefill about 10x slower); start mlxd with "
            f"LD_PRELOAD={choice.library}"
        )
    return choice.missing, choice.summary
