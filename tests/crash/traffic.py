"""Client traffic for the crash loop: admin loads and unloads, chat requests, streamed or not."""

from __future__ import annotations

import random
import threading
import time
from collections import Counter
from collections.abc import Sequence

import httpx

from tests.crash.journal_view import Ack


class Traffic:
    """A few threads sending a random mix of admin loads/unloads and chat requests."""

    def __init__(
        self, url: str, rng: random.Random, models: Sequence[str], threads: int = 3
    ) -> None:
        self.url = url
        self.models = list(models)
        self.acks: list[Ack] = []
        self.sent = Counter[str]()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._worker, args=(random.Random(rng.random()),), daemon=True)
            for _ in range(threads)
        ]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(15)

    def _worker(self, rng: random.Random) -> None:
        with httpx.Client(base_url=self.url, timeout=10) as client:
            while not self._stop.is_set():
                try:
                    self._one(client, rng)
                except httpx.HTTPError:
                    if self._stop.wait(0.05):
                        return

    def _one(self, client: httpx.Client, rng: random.Random) -> None:
        model = rng.choice(self.models)
        x = rng.random()
        if x < 0.3:
            self.sent["admin load"] += 1
            sent = time.time()
            r = client.post(f"/admin/models/{model}/load")
            if r.status_code == 200:
                self.acks.append(Ack(model, "loaded", sent, time.time()))
        elif x < 0.5:
            self.sent["admin unload"] += 1
            preempt = "true" if rng.random() < 0.3 else "false"
            sent = time.time()
            r = client.post(f"/admin/models/{model}/unload", params={"preempt": preempt})
            if r.status_code == 200:
                self.acks.append(Ack(model, "unloaded", sent, time.time()))
        elif x < 0.9:
            body = {
                "model": model,
                "messages": [{"role": "user", "content": "hello"}],
                "max_tokens": rng.randint(3, 20),
            }
            if rng.random() < 0.5:
                self.sent["chat stream"] += 1
                with client.stream(
                    "POST", "/v1/chat/completions", json={**body, "stream": True}
                ) as r:
                    for _ in r.iter_lines():
                        pass
            else:
                self.sent["chat"] += 1
                client.post("/v1/chat/completions", json=body)
        else:
            self._stop.wait(rng.uniform(0, 0.1))
