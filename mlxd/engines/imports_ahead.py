"""mlx-lm imported on a background thread during start-up, and the wait for it before a load.

Importing mlx-lm takes about 1.5 s of one core on a 2-core machine, most of it
transformers, and the first load of an in-process MLX model would pay it
after the daemon already listens. :func:`start` begins that import while the
daemon waits for its journal writer process. transformers and
huggingface_hub install lazy modules that are not safe to import from two
threads at once (a second thread can see ``cannot import name
'PreTrainedTokenizerFast' from 'transformers'``), so every load first calls
:func:`wait` (off the Trio thread), which returns once the import has ended.

Most of transformers' import is a scan of its own source: transformers 5
builds its lazy import structure by reading every file under
``transformers/models`` (about 2,300 of them) for ``__all__`` and
``@requires``, in ``create_import_structure_from_path``, which is cached with
``lru_cache(maxsize=128)``. That tree has about 560 folders, so the cache
keeps nothing useful, and the scan runs twice: once for ``import
transformers`` and again for ``transformers.models`` (which every
``AutoTokenizer`` import needs), about 0.45 s of the GIL on this machine for
the second. :func:`scan_once` makes that function's cache unbounded as its
module is first imported, so the second scan is answered from the first one's
results; its result is the same (every lazy-module table compared equal). It
does nothing when transformers is imported already, or when the function is
no longer there (another transformers version).
"""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import logging
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

log = logging.getLogger(__name__)

#: the module whose scan function gets an unbounded cache, and that function
SCAN_MODULE = "transformers.utils.import_utils"
SCAN_FUNCTION = "create_import_structure_from_path"

_thread: threading.Thread | None = None
_lock = threading.Lock()


def start() -> None:
    """Begin importing mlx-lm on a daemon thread (once per process)."""
    global _thread
    scan_once()
    if _thread is None:
        _thread = threading.Thread(target=_import, name="mlxd-import", daemon=True)
        _thread.start()


def wait() -> None:
    """Return once the import begun by :func:`start` has ended (at once if none was)."""
    scan_once()  # a load whose process did not import ahead imports mlx-lm itself next
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


def scan_once() -> None:
    """Make transformers scan its source once per process, not twice (module docstring).

    Call before transformers is imported; idempotent and thread-safe.
    """
    with _lock:
        if SCAN_MODULE in sys.modules or any(isinstance(f, _ScanOnce) for f in sys.meta_path):
            return
        sys.meta_path.insert(0, _ScanOnce())


class _ScanOnce(importlib.abc.MetaPathFinder):
    """Finds :data:`SCAN_MODULE` as the path finder does, and caches its scan once it has run.

    It answers once, then stays inert in ``sys.meta_path`` (removing a finder could make
    another thread's import, iterating that list, skip the next one).
    """

    def __init__(self) -> None:
        self.used = False

    def find_spec(
        self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname != SCAN_MODULE or self.used:
            return None
        self.used = True  # under the module's import lock
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        loader: Any = spec.loader if spec is not None else None
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        exec_module = loader.exec_module

        def exec_then_cache(module: ModuleType) -> None:
            exec_module(module)
            scan = getattr(module, SCAN_FUNCTION, None)
            uncached = getattr(scan, "__wrapped__", None)  # under its lru_cache(maxsize=128)
            if callable(uncached):
                setattr(module, SCAN_FUNCTION, functools.lru_cache(maxsize=None)(uncached))

        loader.exec_module = exec_then_cache
        return spec
