"""mlx-lm imported on a background thread during start-up, and the wait for it before a load.

Importing mlx-lm takes about 1.5 s of one core on a 2-core machine, most of it
transformers, and the first load of an in-process MLX model would pay it
after the daemon already listens. :func:`start` begins that import while the
daemon waits for its journal writer process. transformers and
huggingface_hub install lazy modules that are not safe to import from two
threads at once (a second thread can see ``cannot import name
'PreTrainedTokenizerFast' from 'transformers'``), so every load first calls
:func:`wait` (off the Trio thread), which returns once the import has ended.
"""

from __future__ import annotations

import logging
import threading

log = logging.getLogger(__name__)

_thread: threading.Thread | None = None


def start() -> None:
    """Begin importing mlx-lm on a daemon thread (once per process)."""
    global _thread
    if _thread is None:
        _thread = threading.Thread(target=_import, name="mlxd-import", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once the import begun by :func:`start` has ended (at once if none was)."""
    if _thread is not None:
        _thread.join()


def _import() -> None:
    # only third-party modules: an mlxd module imported here and by the Trio thread at once
    # could meet a circular import half-way; the engine's own import then finds these loaded
    try:
        import mlx_lm.generate
        import mlx_lm.utils  # noqa: F401
    except Exception as e:  # the load reports it properly
        log.debug("importing mlx-lm ahead of the first load failed: %s", e)
