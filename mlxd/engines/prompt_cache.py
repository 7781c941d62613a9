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

Everything here holds MLX arrays: it lives on the engine's MLX thread only.
"""

from __future__ import annotations

from typing import Any

_KEY = "model"  # one model per engine: the trie's model key is a constant


class PromptCache:
    """LRU prompt cache bounded by bytes (see the module docstring)."""

    def __init__(self, max_bytes: int) -> None:
        from mlx_lm.models.cache import LRUPromptCache

        self.max_bytes = max_bytes
        self._lru = LRUPromptCache(max_size=1 << 30, max_bytes=max(0, max_bytes))
        self.hits = 0
        self.misses = 0

    @property
    def nbytes(self) -> int:
        return int(self._lru.nbytes)

    def __len__(self) -> int:
        return len(self._lru)

    def fetch(self, ids: list[int]) -> tuple[list[Any] | None, list[int]]:
        """``(a copy of the longest cached prefix's KV, the tokens still to process)``.

        At least one token is always left to process (the model needs it to
        produce the first logits); ``(None, ids)`` on a miss.
        """
        if self.max_bytes <= 0 or len(self._lru) == 0:
            self.misses += 1
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
            self.misses += 1
            return None, ids
        self.hits += 1
        return cache, list(rest)

    def insert(self, tokens: list[int], cache: list[Any]) -> None:
        """Keep ``cache`` (the KV of exactly ``tokens``), evicting the least recently used beyond the bound."""
        if self.max_bytes <= 0 or not tokens or not cache:
            return
        self._lru.insert_cache(_KEY, list(tokens), cache)

    def clear(self) -> None:
        self._lru.trim_to(n_sequences=0)
