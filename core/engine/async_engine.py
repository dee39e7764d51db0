"""The engine's step loop in a background thread, streaming each request's outputs to asyncio.

Only the engine thread touches the engine: callers check a request on their own thread (so a bad
one fails at once, before anything is queued) and hand it over with an abort, if any, through a
command queue, so the event loop never waits for a step to end. `add_request()` returns a
RequestStream, an async iterator of RequestOutputs (each with the text and tokens new since the
previous one); closing it early (a client that disconnected, a cancelled task) aborts the request,
which frees its blocks. `add_pooling()` hands over an embeddings request the same way and returns a
PoolingStream, whose `result()` awaits its vectors; closing it first aborts the request between two
of its slices. The engine thread only steps the core; detokenizing and stop strings run
in the stream, on the consumer's event loop, which tells the core when a stop string ends a sample.
A step that fails fails the requests in it, and the loop goes on serving, unless it raised an
EngineFailure (or `fail()` was called): then every request fails, the loop ends, and `failure` says why.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
from collections.abc import AsyncIterator, Callable

from candelabra.core.engine.engine import LLMEngine, RequestOutput
from candelabra.core.engine.output_processor import OutputProcessor
from candelabra.core.engine.pooling import PooledOutput, PoolingJob
from candelabra.core.requests.sampling_params import SamplingParams
from candelabra.core.worker.failure import EngineFailure

log = logging.getLogger("candelabra")

# An engine idle this long gives its backend's cached memory back (Backend.release_cached_memory), on
# every tensor-parallel rank: long enough that back-to-back requests keep it, short enough to follow
# the end of a burst.
RELEASE_AFTER_IDLE_SECONDS = 2.0


class EngineStopping(RuntimeError):
    """Delivered to the requests still running when the server stops."""


class RequestStream:
    """One request's outputs, turned into text here, on the consumer's side of the queue."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue,
                 processor: OutputProcessor) -> None:
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.prompt_token_ids = processor.prompt_token_ids
        self._processor = processor
        self.finished = False

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        if isinstance(item, BaseException):
            self.finished = True
            raise item
        output, stopped = self._processor.process(item)
        for index in stopped:
            self.engine.finish_sample(self.request_id, index)
        self.finished = output.finished
        return output

    def close(self) -> None:
        """Abort the request unless it has finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class PoolingStream:
    """One embeddings request's result, awaited on the consumer's side of the queue."""

    def __init__(self, engine: AsyncEngine, request_id: str, queue: asyncio.Queue) -> None:
        self.engine, self.request_id, self._queue = engine, request_id, queue
        self.finished = False

    async def result(self) -> PooledOutput:
        try:
            item = await self._queue.get()
        except BaseException:
            self.close()
            raise
        self.finished = True
        if isinstance(item, BaseException):
            raise item
        return item

    def close(self) -> None:
        """Abort the request unless it has finished; safe to call more than once."""
        if not self.finished:
            self.finished = True
            self.engine.abort(self.request_id)


class AsyncEngine:
    """Steps an LLMEngine on a thread of its own. Given a function that builds the engine instead,
    the thread builds it first (the constructor waits, and raises what building raised), so that
    loading the model and stepping it happen on one thread: a CPU backend's OpenMP runtime keeps a
    team of worker threads for each thread that runs parallel work, and with two teams on a machine
    with as many cores as one team has threads, libgomp stops spinning between ops and parks its
    workers instead (the default model's decode step took 64 ms instead of 46 on 2 cores)."""

    def __init__(self, engine: LLMEngine | Callable[[], LLMEngine]) -> None:
        self._commands: collections.deque = collections.deque()
        self._work = threading.Event()
        self._streams: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        # Each counter is written by one thread only: handed over by callers, taken by the loop.
        self._adds_handed, self._adds_taken = 0, 0
        self._counts = (0, 0)  # running and waiting requests, published by the engine thread
        self._stopping = False
        self._stepped_since_release = False
        self.failure: str | None = None  # why the engine stopped serving, when it failed
        if isinstance(engine, LLMEngine):
            self.llm_engine, self.core = engine, engine.core
            self._thread = threading.Thread(target=self._loop, name="candelabra-engine", daemon=True)
            self._thread.start()
            return
        built = threading.Event()
        failure: list[BaseException] = []
        self._thread = threading.Thread(target=self._build_then_loop, args=(engine, built, failure),
                                        name="candelabra-engine", daemon=True)
        self._thread.start()
        built.wait()
        if failure:
            raise failure[0]

    def _build_then_loop(self, build: Callable[[], LLMEngine], built: threading.Event,
                         failure: list[BaseException]) -> None:
        try:
            engine = build()
            self.llm_engine, self.core = engine, engine.core
        except BaseException as exc:  # noqa: BLE001 - raised again on the constructing thread
            failure.append(exc)
            return
        finally:
            built.set()
        self._loop()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def num_waiting(self) -> int:
        """Requests not yet running: handed over, queued in the scheduler, or swapped out."""
        return self._adds_handed - self._adds_taken + self._counts[1]

    @property
    def num_running(self) -> int:
        return self._counts[0]

    def add_request(self, request_id: str, prompt: str | list[int],
                    params: SamplingParams | None = None) -> RequestStream:
        """Check and queue a request; ValueError at once for a bad one. Call from the event loop
        that will consume the stream."""
        if self.failure is not None:
            raise EngineStopping(f"the engine has stopped: {self.failure}")
        checked = self.llm_engine.check_request(prompt, params)
        queue: asyncio.Queue = asyncio.Queue()
        self._adds_handed += 1
        self._commands.append(("add", request_id, checked, (asyncio.get_running_loop(), queue)))
        self._work.set()
        return RequestStream(self, request_id, queue, self.llm_engine.output_processor(request_id, checked))

    async def generate(self, request_id: str, prompt: str | list[int],
                       params: SamplingParams | None = None) -> AsyncIterator[RequestOutput]:
        """Outputs of one request as they come; raises ValueError for a bad request."""
        stream = self.add_request(request_id, prompt, params)
        try:
            async for output in stream:
                yield output
        finally:
            stream.close()

    def abort(self, request_id: str) -> None:
        self._commands.append(("abort", request_id))
        self._work.set()

    def finish_sample(self, request_id: str, index: int) -> None:
        """End one sample of a request, whose stop string appeared."""
        self._commands.append(("finish_sample", request_id, index))
        self._work.set()

    def add_pooling(self, request_id: str, job: PoolingJob) -> PoolingStream:
        """Queue an embeddings request, to run a slice a step beside generation. Call from the event loop
        that will await the stream."""
        if self.failure is not None or self._stopping:
            raise EngineStopping(f"the engine has stopped: {self.failure or 'the server is shutting down'}")
        queue: asyncio.Queue = asyncio.Queue()
        self._adds_handed += 1
        self._commands.append(("pool", request_id, job, (asyncio.get_running_loop(), queue)))
        self._work.set()
        return PoolingStream(self, request_id, queue)

    def stop_all(self, message: str = "the server is shutting down") -> None:
        """End every request in flight with EngineStopping(message); the engine keeps running."""
        self._commands.append(("stop_all", message))
        self._work.set()

    def fail(self, reason: str) -> None:
        """From any thread: the engine cannot go on (`reason`); fail every request and stop the loop."""
        self._commands.append(("fail", reason))
        self._work.set()

    def shutdown(self) -> None:
        self._stopping = True
        self._work.set()
        self._thread.join(timeout=30)

    def _loop(self) -> None:
        while not self._stopping and self.failure is None:
            self._run_commands()
            self._publish_counts()
            if self.failure is not None:
                break
            if not self.core.has_unfinished_requests():
                self._wait_for_work()
                continue
            self._stepped_since_release = True
            try:
                outputs = self.core.step()
            except EngineFailure as exc:
                log.error("the engine cannot go on: %s", exc)
                self._stop_failed(str(exc))
                break
            except Exception as exc:  # noqa: BLE001 - fail the requests in flight, keep serving
                log.exception("engine step failed")
                self._fail_all(exc)
                continue
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if output.finished:
                    self._streams.pop(output.request_id, None)
                if stream is not None and not _deliver(stream, output):
                    self._streams.pop(output.request_id, None)
                    self.core.abort_request(output.request_id)

    def _wait_for_work(self) -> None:
        """Sleep until a command arrives; after RELEASE_AFTER_IDLE_SECONDS without one, first tell
        the backend (every rank's) to give back the memory it keeps for its steps."""
        if self._stepped_since_release and not self._work.wait(RELEASE_AFTER_IDLE_SECONDS):
            self._stepped_since_release = False
            try:
                self.core.runner.release_cached_memory()
            except EngineFailure as exc:  # the other ranks could not be told
                log.error("the engine cannot go on: %s", exc)
                self._stop_failed(str(exc))
                return
            except Exception:  # noqa: BLE001 - memory kept is no reason to stop serving
                log.exception("the backend could not release its cached memory")
        self._work.wait()
        self._work.clear()

    def _publish_counts(self) -> None:
        """Requests running and waiting; of the embeddings requests, the oldest runs and the others wait."""
        scheduler, pooling = self.core.scheduler, len(self.core.pooling)
        waiting = {seq.request_id for seq in scheduler.waiting}
        waiting.update(group[0].request_id for group in scheduler.swapped)
        self._counts = (len({seq.request_id for seq in scheduler.running}) + min(pooling, 1),
                        len(waiting) + max(pooling - 1, 0))

    def _run_commands(self) -> None:
        while self._commands:
            command = self._commands.popleft()
            if command[0] == "abort":
                log.debug("abort %s", command[1])
                self._streams.pop(command[1], None)
                self.core.abort_request(command[1])
                continue
            if command[0] == "finish_sample":
                self.core.finish_sample(command[1], command[2])
                if command[1] not in self.core.requests:  # its last sample: the stream has all it needs
                    self._streams.pop(command[1], None)
                continue
            if command[0] == "stop_all":
                self._fail_all(EngineStopping(command[1]))
                continue
            if command[0] == "fail":
                log.error("the engine cannot go on: %s", command[1])
                self._stop_failed(command[1])
                return
            kind, request_id, work, stream = command
            self._adds_taken += 1
            try:
                if kind == "pool":
                    log.debug("pool %s: %d inputs, %d tokens", request_id, len(work.inputs), work.num_tokens)
                    self.core.add_pooling(request_id, work)
                else:
                    log.debug("add %s: %d prompt tokens, up to %d new", request_id, len(work.prompt_token_ids),
                              work.max_tokens)
                    self.core.add_request(request_id, work)
            except Exception as exc:  # noqa: BLE001 - the error belongs to that request's caller
                _deliver(stream, ValueError(str(exc)))
                continue
            self._streams[request_id] = stream

    def _stop_failed(self, reason: str) -> None:
        self.failure = reason
        self._fail_all(EngineFailure(reason))
        for command in self._commands:
            if command[0] in ("add", "pool"):
                _deliver(command[3], EngineFailure(reason))
        self._commands.clear()

    def _fail_all(self, exc: Exception) -> None:
        error = exc if isinstance(exc, (EngineStopping, EngineFailure)) else RuntimeError(f"generation failed: {exc}")
        for request_id, stream in list(self._streams.items()):
            self.core.abort_request(request_id)
            _deliver(stream, error)
        self._streams.clear()


def _deliver(stream: tuple[asyncio.AbstractEventLoop, asyncio.Queue], item) -> bool:
    """Hand `item` to the consumer's event loop; False when that loop has closed."""
    loop, queue = stream
    try:
        loop.call_soon_threadsafe(queue.put_nowait, item)
    except RuntimeError:
        return False
    return True
