"""The reply cache of the search tools: the G rollouts of a query ask once.

Not part of the paper's method. The G rollouts of one query often issue the same search at
the same moment (tool calls run concurrently); answering repeats from a cache, and letting a
call wait for the identical one already in flight, sends one request instead of G.
"""

import threading
from collections import OrderedDict
from concurrent.futures import Future


class ReplyCache:
    """A tool's replies by command, bounded, least recently used dropped first.

    Thread-safe, and a call whose command is already in flight waits for that call's
    reply instead of sending its own: the G rollouts of a query often issue the same
    search at the same moment (tools run concurrently, run_tool_calls), and a cache
    filled only after a reply would miss all G. A reply the command caused is kept, a
    failure included ("no passages match"): asking again would give the same, and
    whether a repeat waited or came later must not change what the run counts. An
    infrastructure failure (network, quota) is shared with those waiting, never kept."""

    def __init__(self, size: int):
        self.size = size
        self.hits = 0    # answered without a call of their own (from the cache, or by waiting)
        self.misses = 0  # calls made
        self._done: OrderedDict[str, object] = OrderedDict()
        self._pending: dict[str, Future] = {}
        self._lock = threading.Lock()

    def get(self, key: str, call):
        """The reply to `key`: kept, awaited, or call() (a ToolResult, whose .infra says
        whether to keep it)."""
        with self._lock:
            if key in self._done:
                self._done.move_to_end(key)
                self.hits += 1
                return self._done[key]
            pending = self._pending.get(key)
            first = pending is None
            if first:
                pending = self._pending[key] = Future()
                self.misses += 1
            else:
                self.hits += 1
        if not first:
            return pending.result()
        try:
            result = call()
        except BaseException as e:  # run() never raises; if it did, no waiter may hang
            with self._lock:
                del self._pending[key]
            pending.set_exception(e)
            raise
        with self._lock:
            del self._pending[key]
            if not result.infra:
                self._done[key] = result
                while len(self._done) > self.size:
                    self._done.popitem(last=False)
        pending.set_result(result)
        return result
