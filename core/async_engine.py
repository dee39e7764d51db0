"""The engine's step loop in a background thread, streaming each request's outputs to asyncio.

`generate()` is an async iterator of RequestOutputs (each carrying the new text and tokens since
the previous one). A consumer that stops iterating early (a client that disconnected, a
cancelled task) aborts its request, which frees its blocks at once. A step that fails fails the
requests in it, and the loop goes on serving the others.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from collections.abc import AsyncIterator

from candelabra.core.engine import LLMEngine, RequestOutput
from candelabra.core.sampling_params import SamplingParams

log = logging.getLogger("candelabra")


class AsyncEngine:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._lock = threading.Lock()
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._stopping = False
        self._thread = threading.Thread(target=self._loop, name="candelabra-engine", daemon=True)
        self._thread.start()

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; raises ValueError at once for a bad request."""
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt, params)
            self._streams[request_id] = (asyncio.get_running_loop(), queue)
        self._work.set()
        finished = False
        try:
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._streams.pop(request_id, None)
            self.engine.abort_request(request_id)

    def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stopping:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
            if not busy:
                self._work.wait()
                self._work.clear()
                continue
            with self._lock:
                try:
                    outputs = self.engine.step()
                except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                    log.exception("engine step failed")
                    self._fail_all(exc)
                    continue
                deliveries = [(self._streams.get(o.request_id), o) for o in outputs]
                for output in outputs:
                    if output.finished:
                        self._streams.pop(output.request_id, None)
            for stream, output in deliveries:
                if stream is not None:
                    loop, queue = stream
                    loop.call_soon_threadsafe(queue.put_nowait, output)

    def _fail_all(self, exc: Exception) -> None:
        error = RuntimeError(f"generation failed: {exc}")
        for request_id, (loop, queue) in list(self._streams.items()):
            self.engine.abort_request(request_id)
            loop.call_soon_threadsafe(queue.put_nowait, error)
        self._streams.clear()
