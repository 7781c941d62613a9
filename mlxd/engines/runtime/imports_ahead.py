"""mlx-lm imported on a background thread during start-up, the wait for it before a load,
and transformers' source scan done once (and kept on disk) instead of twice per start.

Importing mlx-lm takes about 1.5 s of one core on a 2-core machine, most of it
transformers, and the first load of an in-process MLX model would pay it
after the daemon already listens. :func:`start` begins that import while the
daemon waits for its journal writer process. transformers and
huggingface_hub install lazy modules that are not safe to import from two
threads at once (a second thread can see ``cannot import name
'PreTrainedTokenizerFast' from 'transformers'``), so every load first calls
:func:`wait` (off the Trio thread while it runs), which returns once the import
has ended.

Most of transformers' import is a scan of its own source: transformers 5
builds its lazy import structure by reading every file under
``transformers/models`` (about 2,300 of them) for ``__all__`` and
``@requires``, in ``create_import_structure_from_path``, which is cached with
``lru_cache(maxsize=128)``. That tree has about 560 folders, so the cache
keeps nothing useful, and the scan runs twice: once for ``import
transformers`` and again for ``transformers.models`` (which every
``AutoTokenizer`` import needs), about 0.45 s of the GIL on this machine for
the second. :func:`scan_once` replaces that function with
:meth:`ScanStore.scan` (an unbounded cache) as its module is first imported,
so the second scan is answered from the first one's results; transformers'
lazy-module tables come out the same (``tests/unit/test_imports_ahead.py``).
It does nothing when transformers is imported already, or when the function
is no longer there (another transformers version).

The first scan (about 0.9 s) is kept on disk between runs too
(:class:`ScanStore`, in ``$XDG_CACHE_HOME/mlxd``, else ``~/.cache/mlxd``;
``MLXD_SCAN_CACHE=0`` turns it off). It is valid for as long as transformers'
files are as they were: its key is every file's path, size and mtime under the
transformers package (the test Python's bytecode cache makes of a source), so
an upgrade, a reinstall or an edited file makes it scan again and rewrite it.
Computing the key costs about 30 ms; reading the file, about 20 ms.
Any error reading or writing it falls back to scanning. :func:`save_scans`
writes what the process scanned, once its import of mlx-lm has ended.
"""

from __future__ import annotations

import hashlib
import importlib.abc
import importlib.machinery
import logging
import marshal
import os
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import ModuleType
from typing import Any

from mlxd.engines.runtime.memory import limit_malloc_arenas, settle_heap

log = logging.getLogger(__name__)

#: the module whose scan function gets an unbounded cache, and that function
SCAN_MODULE = "transformers.utils.import_utils"
SCAN_FUNCTION = "create_import_structure_from_path"
#: ``0`` keeps the scan's results off the disk
CACHE_ENV = "MLXD_SCAN_CACHE"
#: changes whenever the file's layout does
CACHE_FORMAT = 1

#: set when start() has queued the import, and when it has ended
_started = False
_done = threading.Event()
_lock = threading.Lock()
#: the scan's results of this process (None until transformers' scan function is replaced)
_store: ScanStore | None = None


def start() -> None:
    """Begin importing mlx-lm on a pooled MLX thread (once per process).

    The thread then waits in the pool of :mod:`mlxd.engines.runtime.mlx_thread`, so the
    first load runs on it, its MLX state already made (a load on a thread new to
    MLX took 4 ms longer, measured on the tiny demo model).
    """
    global _started
    scan_once()
    if not _started:
        _started = True
        limit_malloc_arenas()  # before the process's first extra thread (see mlxd.engines.runtime.memory)
        from mlxd.engines.runtime.mlx_thread import spare_thread

        try:
            spare_thread("mlxd-import", _import)
        except BaseException:
            _done.set()  # no import to wait for: the load imports mlx-lm itself
            raise


def busy() -> bool:
    """Whether the import begun by :func:`start` is still running (:func:`wait` would block)."""
    return _started and not _done.is_set()


def wait() -> None:
    """Return once the import begun by :func:`start` has ended (at once if none was)."""
    scan_once()  # a load whose process did not import ahead imports mlx-lm itself next
    if _started:
        _done.wait()


def _import() -> None:
    # only third-party modules: an mlxd module imported here and by the Trio thread at once
    # could meet a circular import half-way; the engine's own import then finds these loaded
    try:
        import mlx.core as mx
        import mlx_lm.generate
        import mlx_lm.utils  # noqa: F401

        mx.eval(mx.zeros(1))  # makes this thread's MLX state, for the load that runs here next
        settle_heap()  # the modules last as long as the process: out of full collections
    except Exception as e:  # the load reports it properly
        log.debug("importing mlx-lm ahead of the first load failed: %s", e)
    finally:
        try:
            save_scans()
        finally:
            _done.set()


def save_scans() -> None:
    """Write what this process scanned to the disk cache, if it scanned anything new."""
    store = _store
    if store is not None:
        store.save()


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
            global _store
            exec_module(module)
            scan = getattr(module, SCAN_FUNCTION, None)
            uncached = getattr(scan, "__wrapped__", None)  # under its lru_cache(maxsize=128)
            where = getattr(module, "__file__", None)
            if callable(uncached) and isinstance(where, str):  # .../transformers/utils/x.py
                _store = ScanStore(uncached, Path(where).resolve().parent.parent)
                setattr(module, SCAN_FUNCTION, _store.scan)

        loader.exec_module = exec_then_cache
        return spec


class ScanStore:
    """transformers' scan results by folder, for this process and between runs (module docstring).

    :meth:`scan` stands in for ``create_import_structure_from_path``: a folder
    already scanned (by this process, or by an earlier one while the files were
    the same) is answered from memory, any other is scanned (the scan's own
    recursion comes back here for each subfolder). Results are shared, as the
    scan's ``lru_cache`` shares them; transformers only reads them.
    """

    def __init__(self, uncached: Callable[[str], Any], package: Path) -> None:
        self._uncached = uncached
        self.package = package
        self.path = cache_file(package)
        #: folder -> its import structure
        self.known: dict[str, Any] = {}
        self._key: str | None = None
        self._loaded = False
        self._dirty = False

    def scan(self, module_path: Any) -> Any:
        folder = os.fspath(module_path)
        if os.path.isfile(folder):  # the scan takes a file to mean its folder
            folder = os.path.dirname(folder)
        if not self._loaded:
            self._loaded = True
            self._load()
        found = self.known.get(folder)
        if found is None:
            found = self.known[folder] = self._uncached(folder)
            self._dirty = True
        return found

    def _load(self) -> None:
        if self.path is None:
            return
        try:
            self._key = fingerprint(self.package)
            with self.path.open("rb") as f:
                data = marshal.load(f)
        except (OSError, EOFError, ValueError, TypeError) as e:
            log.debug("transformers scan cache: not read (%s)", e)
            return
        if isinstance(data, tuple) and data[:2] == (CACHE_FORMAT, self._key):
            self.known.update(data[2])

    def save(self) -> None:
        """Write the results if this process scanned anything; errors are only logged."""
        if not self._dirty or self.path is None or self._key is None:
            return
        self._dirty = False
        tmp = self.path.with_name(f"{self.path.name}.{os.getpid()}.tmp")
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp.write_bytes(marshal.dumps((CACHE_FORMAT, self._key, self.known)))
            os.replace(tmp, self.path)  # whole or not at all, whoever reads it meanwhile
        except (OSError, ValueError) as e:
            log.debug("transformers scan cache: not written (%s)", e)
            tmp.unlink(missing_ok=True)


def cache_file(package: Path) -> Path | None:
    """Where the scan results of the transformers installed at ``package`` are kept (None: off)."""
    if os.environ.get(CACHE_ENV) == "0":
        return None
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    tag = hashlib.blake2b(str(package).encode(), digest_size=6).hexdigest()
    return Path(base) / "mlxd" / f"transformers-scan-{tag}.marshal"


def fingerprint(package: Path) -> str:
    """Every file's path, size and mtime under ``package`` (bytecode caches left out), hashed:
    about 30 ms for transformers' 2,900 files."""
    h = hashlib.blake2b(digest_size=16)
    h.update(f"{sys.version}\0{package}\n".encode())
    folders = [str(package)]
    while folders:
        with os.scandir(folders.pop()) as entries:
            for entry in sorted(entries, key=lambda e: e.name):
                if entry.name == "__pycache__":
                    continue
                if entry.is_dir(follow_symlinks=False):
                    folders.append(entry.path)
                    h.update(f"{entry.path}/\n".encode())
                    continue
                st = entry.stat(follow_symlinks=False)
                h.update(f"{entry.path}\0{st.st_size}\0{st.st_mtime_ns}\n".encode())
    return h.hexdigest()
