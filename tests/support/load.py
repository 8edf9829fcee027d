"""A closed-loop chat load: `clients` threads, each sending a request as soon as its last one ended (then
pausing `pause` s), counting what was served and what failed. Used by the planner's tests and benchmarks."""

from __future__ import annotations

import threading

import httpx

from tests.support.deployment import MODEL


class Load:
    def __init__(self, url: str, clients: int, pause: float, *, words: int = 100, max_tokens: int = 8,
                 model: str = MODEL) -> None:
        self.url, self.pause, self.words, self.max_tokens, self.model = url, pause, words, max_tokens, model
        self.done = threading.Event()
        self.served = 0
        self.failures: list[str] = []
        self.threads = [threading.Thread(target=self._client, args=(n,)) for n in range(clients)]
        for thread in self.threads:
            thread.start()

    def _client(self, n: int) -> None:
        prompt = f"client {n}: " + " ".join(f"word{i}" for i in range(self.words))
        with httpx.Client(timeout=300) as http:
            while not self.done.is_set():
                try:
                    response = http.post(f"{self.url}/v1/chat/completions", json={
                        "model": self.model, "max_tokens": self.max_tokens,
                        "messages": [{"role": "user", "content": prompt}]})
                    if response.status_code == 200:
                        self.served += 1
                    else:
                        self.failures.append(f"{response.status_code} {response.text[:200]}")
                except httpx.HTTPError as e:
                    self.failures.append(repr(e))
                self.done.wait(self.pause)

    def stop(self) -> None:
        self.done.set()
        for thread in self.threads:
            thread.join()
