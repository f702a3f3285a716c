"""
A KV-event publisher that should have spoken
============================================

A worker that names a publisher is matched on its events alone: until it stores a
block, it holds nothing. So a publisher nobody hears turns ``cache_aware`` into
"every request is a miss" for that worker, silently. It happens: vLLM *connects*
to an endpoint with a named host (``tcp://10.0.0.5:5557``) instead of binding it
(only ``tcp://*:5557`` binds), while its replay endpoint is always bound and
answers; prefix caching may be off; a proxy may sit in the way.

:class:`KvSilence` says when to stop trusting such a publisher: requests were
placed on the worker, and for ``after_s`` after the first of them not one batch
arrived. (An engine stores a block for any prompt longer than one block that it
does not hold yet, so such a request is followed by an event within a prefill.)
The worker is then matched on the router's approximate tree until its next batch.

Only a request that should make the engine store a block starts the wait
(:meth:`KvSilence.expect`, as :meth:`~meshkit.core.kv_index.KvIndex.would_store`
says): its prompt fills a block of the worker's size that the index does not show
the worker holding already. A worker that serves short prompts alone, or prompts
it holds whole (prefix hits), has nothing to publish, and is not taken for silent.
Where meshkit did not compute the prompt's blocks (no tokenizer for its model, an
API it does not render) or does not know the worker's block size yet, the request
counts. A false alarm left (an engine with prefix caching off) costs no more than
the tree, which is what a worker without events gets. A silence that begins while
all traffic hits blocks the index still shows is seen at the first request with a
new block.

Pure: the subscriber calls it with the router's clock.
"""

from __future__ import annotations

__all__ = ["KvSilence"]


class KvSilence:
    """When each publisher last spoke, and which ones turned silent.

    :param after_s: how long a placed request may go unanswered by any event
        (0: never silent).
    """

    def __init__(self, after_s: float) -> None:
        self.after_s = after_s
        self._heard: dict[str, float] = {}
        #: the first expected placement after the last batch, per worker
        self._waiting: dict[str, float] = {}
        self._silent: set[str] = set()

    def heard(self, worker_id: str, now: float) -> bool:
        """A batch arrived (or the subscription began). True when the worker was
        silent until now."""
        self._heard[worker_id] = now
        self._waiting.pop(worker_id, None)
        if worker_id in self._silent:
            self._silent.discard(worker_id)
            return True
        return False

    def expect(self, worker_id: str, now: float) -> None:
        """A request that should make the worker store a block was placed on it at
        ``now``: the first one since its last batch starts the wait."""
        if worker_id in self._heard and worker_id not in self._waiting:
            self._waiting[worker_id] = now

    def check(self, worker_id: str, now: float) -> bool:
        """Whether ``worker_id`` turned silent just now (True once per silence)."""
        since = self._waiting.get(worker_id)
        if not self.after_s or since is None or worker_id in self._silent:
            return False
        if now - since < self.after_s:
            return False
        self._silent.add(worker_id)
        return True

    def silent(self, worker_id: str) -> bool:
        return worker_id in self._silent

    def heard_at(self, worker_id: str) -> float | None:
        """When its last batch arrived (or its subscription began); None: never."""
        return self._heard.get(worker_id)

    def forget(self, worker_id: str) -> None:
        """The worker left (or its subscription ended)."""
        self._heard.pop(worker_id, None)
        self._waiting.pop(worker_id, None)
        self._silent.discard(worker_id)
