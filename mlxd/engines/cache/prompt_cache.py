"""A model's prompt cache: the KV of earlier prompts, reused by the longest cached prefix.

Built on mlx-lm's ``LRUPromptCache`` (the one ``mlx_lm.server`` uses): a token
trie whose entries are per-sequence KV caches. A lookup returns a *copy* of
the entry that shares the longest prefix with the new prompt (an entry longer
than the prompt is trimmed back to the shared part), so the running
generation owns its KV and the cache stays unchanged. Entries are inserted
when a generation finishes (prompt + the generated tokens fed back to the
model, so the next turn of a conversation finds its whole history; a
generation that ends at its first token leaves its prompt) and evicted least recently used first
once the cache holds more than ``max_bytes`` (``prompt_cache_gb``).

With a disk tier (:class:`~mlxd.engines.cache.prompt_disk.PromptDisk`, on when
``manager.prompt_cache_disk_gb`` is), a lookup also asks the tier for its
longest prefix: when the disk holds more of the prompt than memory, that entry
is read (checked), joins the memory cache and serves the prompt; ``fetch`` says
how many tokens came from disk. Entries of :data:`~mlxd.engines.cache.prompt_disk.LONG_PREFIX_TOKENS`
tokens or more are queued for the disk when inserted (:meth:`PromptCache.persist_pending`
writes them once the model has been idle a moment, when they hold that many tokens beyond what the
disk has of them), and :meth:`PromptCache.persist_all` writes every entry not on
disk yet when the residency ends.

Everything here holds MLX arrays: it lives on the engine's MLX thread only.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable
from typing import Any

from mlxd.engines.cache.prompt_disk import BLOCK, LONG_PREFIX_TOKENS, PromptDisk

log = logging.getLogger(__name__)

_KEY = "model"  # one model per engine: the trie's model key is a constant


class PromptCache:
    """LRU prompt cache bounded by bytes (see the module docstring)."""

    def __init__(self, max_bytes: int, disk: PromptDisk | None = None) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=max(0, max_bytes))
        #: the disk tier (None: off; also off when the memory cache is)
        self.disk = disk if max_bytes > 0 else None
        #: long entries inserted and not written yet: (tokens, cache); at most ``max_bytes``
        #: of them, besides the newest
        self._pending: list[tuple[list[int], list[Any]]] = []
        self.hits = 0
        self.misses = 0
        #: lookups served from disk
        self.disk_hits = 0

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, ids: list[int]) -> tuple[list[Any] | None, list[int], int]:
        """``(a copy of the longest cached prefix's KV, the tokens still to process, how many of
        the cached ones came from disk)``.

        At least one token is always left to process (the model needs it to
        produce the first logits); ``(None, ids, 0)`` on a miss.
        """
        cache, rest = self._from_memory(ids)
        cached = len(ids) - len(rest) if cache is not None else 0
        loaded = self._from_disk(ids, cached)
        if loaded is not None:
            self.disk_hits += 1
            cache, rest = loaded
            return cache, rest, len(ids) - len(rest)
        if cache is None:
            self.misses += 1
            return None, ids, 0
        self.hits += 1
        return cache, rest, 0

    def _from_memory(self, ids: list[int]) -> tuple[list[Any] | None, list[int]]:
        if self.max_bytes <= 0 or len(self._lru) == 0:
            return None, ids
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        cache, rest = self._lru.fetch_nearest_cache(_KEY, ids)
        if cache is not None and not rest:  # the whole prompt is cached: recompute its last token
            trimmed: Any = trim_prompt_cache(cache, 1) if can_trim_prompt_cache(cache) else 0
            if trimmed == 1:
                rest = ids[-1:]
            else:
                cache = None
        if cache is None:
            return None, ids
        return cache, list(rest)

    def _from_disk(self, ids: list[int], cached: int) -> tuple[list[Any], list[int]] | None:
        """The disk tier's entry for ``ids`` when it holds more of them than memory: it joins the
        memory cache, and a copy cut to the shared prefix (one token left) is returned."""
        if self.disk is None:
            return None
        best = self.disk.best(ids)
        if best is None or best[1] < cached + BLOCK:  # a read is worth a block of prefill at least
            return None
        read = self.disk.read(best[0])
        if read is None:
            return None
        from mlx_lm.models.cache import can_trim_prompt_cache, trim_prompt_cache

        tokens, kv = read
        shared = 0
        for a, b in zip(tokens, ids, strict=False):
            if a != b:
                break
            shared += 1
        prefix = min(shared, len(ids) - 1)
        if prefix <= cached:
            return None
        out = kv
        if sum(int(c.nbytes) for c in kv) <= self.max_bytes:  # else it would only evict others
            self._lru.insert_cache(_KEY, tokens, kv)
            out = copy.deepcopy(kv)
        cut = len(tokens) - prefix
        trimmed: Any = trim_prompt_cache(out, cut) if cut and can_trim_prompt_cache(out) else 0
        if trimmed != cut:
            return None
        return out, ids[prefix:]

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep ``cache`` (the KV of exactly ``tokens``), evicting the least recently used beyond
        the bound; a long one is also queued for the disk tier (module docstring)."""
        if self.max_bytes <= 0 or not tokens or not cache:
            return
        self._lru.insert_cache(_KEY, list(tokens), cache)
        if self.disk is not None and len(tokens) >= LONG_PREFIX_TOKENS:
            self._pending.append((list(tokens), cache))
            # a model that is never idle must not hold more than its bound for the disk: the
            # oldest wait for the residency's end (if the memory cache still has them)
            while len(self._pending) > 1 and sum(
                    sum(int(c.nbytes) for c in kv) for _t, kv in self._pending) > self.max_bytes:
                self._pending.pop(0)

    @property
    def has_pending(self) -> bool:
        """Whether long entries wait for :meth:`persist_pending` (read under the loop's lock)."""
        return bool(self._pending) and self.disk is not None

    def persist_pending(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Write the long entries made since the last call (the model is idle), each one that
        holds :data:`~mlxd.engines.cache.prompt_disk.LONG_PREFIX_TOKENS` tokens beyond what the disk
        has of it already: an agent's next turn does not rewrite its whole prefix each time
        (the residency's end writes the rest). When ``stop()`` turns true (a request arrived),
        the entries not yet serialized wait for the next idle moment."""
        pending, self._pending = self._pending, []
        if self.disk is None:
            return
        chosen: list[list[int]] = []  # newest first: a conversation's latest turn holds the rest
        while pending:
            if stop():
                self._pending = pending + self._pending
                return
            tokens, cache = pending.pop()
            best = self.disk.best(tokens)
            held = max([best[1] if best is not None else 0,
                        *(_shared(tokens, c) for c in chosen)])  # fmt: skip
            if len(tokens) - held >= LONG_PREFIX_TOKENS and self.disk.save(tokens, cache):
                chosen.append(tokens)

    def persist_all(self) -> None:
        """Write every entry not on disk yet and wait for the writes (the residency ends); a
        failure is logged, never raised: the unload goes on."""
        if self.disk is None:
            return
        try:
            self.persist_pending()
            for tokens, cache in self._entries():
                self.disk.save(tokens, cache)
            self.disk.flush()
        except Exception:
            log.exception("prompt cache: writing to the disk tier failed")

    def _entries(self) -> list[tuple[list[int], list[Any]]]:
        """The memory cache's entries, least recently used first (mlx-lm's internals, checked:
        without them only the long entries reach the disk)."""
        order = getattr(getattr(self._lru, "_lru", None), "_lrus", None)
        trie = getattr(self._lru, "_trie", None)
        if not isinstance(order, dict) or trie is None:
            log.warning("prompt cache: mlx-lm's LRUPromptCache changed; short entries stay in memory")
            return []
        out = []
        for lru in order.values():
            for model, tokens in list(lru):
                entry = trie.get(model, tokens)
                cache = getattr(entry, "prompt_cache", None)
                if cache is not None:
                    out.append((list(tokens), cache))
        return out

    def clear(self) -> None:
        self._pending = []
        self._lru.trim_to(n_sequences=0)


def _shared(a: list[int], b: list[int]) -> int:
    """How many tokens ``a`` and ``b`` share from the start."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)
