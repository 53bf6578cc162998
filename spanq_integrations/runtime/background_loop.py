"""One event loop in a daemon thread, on which the framework adapters run every call to a backend.

LangChain and LlamaIndex call a model from plain threads (`invoke`, `query`), from the user's event loop
(`ainvoke`, `aquery`) and from notebooks whose loop is already running. A backend's resources belong to the
loop that opened them (an `httpx.AsyncClient`'s connection pool), so the adapters never run a backend on the
caller's loop: they hand the coroutine to this loop and wait for it (sync) or await it (async). Streams forward
each text piece to the consumer as it arrives; closing a stream early cancels its run.
"""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import AsyncIterator, Callable, Coroutine, Iterator
from concurrent.futures import Future
from typing import Any, Generic, TypeVar

from spanq_integrations.backends.protocol import TokenCallback

__all__ = ["AsyncQueryStream", "BackgroundLoop", "QueryStream", "background_loop"]

T = TypeVar("T")
StartRun = Callable[[TokenCallback], Coroutine[Any, Any, T]]
"""Starts a run given the callback that receives its text pieces; the run's result ends the stream."""

_END = object()


class BackgroundLoop:
    """An event loop running forever in a daemon thread, started on first use."""

    def __init__(self, name: str = "spanq-adapters") -> None:
        self.name = name
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                ready = threading.Event()
                loop = asyncio.new_event_loop()

                def run() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                self._thread = threading.Thread(target=run, name=self.name, daemon=True)
                self._thread.start()
                ready.wait()
                self._loop = loop
            return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread

    def submit(self, coro: Coroutine[Any, Any, T]) -> Future[T]:
        """Schedule `coro` on the loop; the returned future cancels it when cancelled."""
        if self.in_loop_thread():
            coro.close()
            raise RuntimeError(
                "a synchronous spanq call was made from inside another one's callback (on the spanq loop "
                "thread); call the async method there instead"
            )
        return asyncio.run_coroutine_threadsafe(coro, self.loop())

    def run(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and wait for its result (from any thread, even one with a running loop)."""
        future = self.submit(coro)
        try:
            return future.result()
        except BaseException:
            future.cancel()
            raise

    async def arun(self, coro: Coroutine[Any, Any, T]) -> T:
        """Run `coro` on the loop and await its result from the caller's loop (cancellation propagates)."""
        if self.in_loop_thread():  # already on it (a callback of another call): just await
            return await coro
        return await asyncio.wrap_future(self.submit(coro))

    def stream(self, start: StartRun[T]) -> QueryStream[T]:
        return QueryStream(self, start)

    def astream(self, start: StartRun[T]) -> AsyncQueryStream[T]:
        return AsyncQueryStream(self, start)


class QueryStream(Generic[T]):
    """Iterates the text pieces of a run (started on the first `next`); `result` holds its result afterwards.

    Closing the iterator early (or dropping it) cancels the run, which aborts the request in the engine."""

    def __init__(self, loop: BackgroundLoop, start: StartRun[T]) -> None:
        self._loop = loop
        self._start = start
        self._future: Future[T] | None = None
        self._pieces: queue.Queue[Any] = queue.Queue()
        self.result: T | None = None

    def __iter__(self) -> Iterator[str]:
        pieces = self._pieces
        self._future = self._loop.submit(self._start(pieces.put))
        self._future.add_done_callback(lambda _: pieces.put(_END))
        try:
            while (item := pieces.get()) is not _END:
                yield item
            self.result = self._future.result()
        finally:
            if not self._future.done():
                self._future.cancel()


class AsyncQueryStream(Generic[T]):
    """`QueryStream` for a consumer on an event loop: `async for piece in stream`, then `stream.result`."""

    def __init__(self, loop: BackgroundLoop, start: StartRun[T]) -> None:
        self._loop = loop
        self._start = start
        self.result: T | None = None

    async def __aiter__(self) -> AsyncIterator[str]:
        consumer = asyncio.get_running_loop()
        pieces: asyncio.Queue[Any] = asyncio.Queue()

        def put(item: Any) -> None:
            try:
                consumer.call_soon_threadsafe(pieces.put_nowait, item)
            except RuntimeError:  # the consumer's loop is closed: nobody reads any more
                pass

        future = self._loop.submit(self._start(put))
        future.add_done_callback(lambda _: put(_END))
        try:
            while (item := await pieces.get()) is not _END:
                yield item
            self.result = future.result()
        finally:
            if not future.done():
                future.cancel()


_shared = BackgroundLoop()


def background_loop() -> BackgroundLoop:
    """The process-wide loop of the framework adapters."""
    return _shared
