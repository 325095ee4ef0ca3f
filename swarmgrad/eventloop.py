"""Event-loop plumbing: uvloop where installed, and a loop in a background thread for sync code."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import sys
import threading
from typing import Any, Awaitable, Coroutine, Iterator, TypeVar

if sys.version_info >= (3, 11):
    from asyncio import timeout
else:  # Python 3.10
    from async_timeout import timeout

__all__ = ["BackgroundLoop", "new_event_loop", "run", "timeout", "shutdown_signal"]

T = TypeVar("T")

try:
    import uvloop
except ImportError:  # Windows, or installed without it
    uvloop = None


def new_event_loop() -> asyncio.AbstractEventLoop:
    return uvloop.new_event_loop() if uvloop is not None else asyncio.new_event_loop()


def run(main: Coroutine[Any, Any, T]) -> T:
    """asyncio.run on uvloop where installed."""
    loop = new_event_loop()
    try:
        return loop.run_until_complete(main)
    finally:
        try:
            loop.run_until_complete(_cancel_remaining_tasks())
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class BackgroundLoop:
    """One event loop in a daemon thread; sync code submits coroutines to it and waits for results.

    This is how a plain training loop drives a peer whose networking is all asyncio.
    """

    def __init__(self, name: str = "swarmgrad-loop"):
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._thread.start()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    def submit(self, coroutine: Awaitable[T]) -> concurrent.futures.Future[T]:
        return asyncio.run_coroutine_threadsafe(coroutine, self._loop)  # type: ignore[arg-type]

    def run(self, coroutine: Awaitable[T], timeout: float | None = None) -> T:
        """Run ``coroutine`` on the loop and wait for it; on timeout it is cancelled and TimeoutError raised."""
        future = self.submit(coroutine)
        try:
            return future.result(timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise TimeoutError(f"operation did not finish within {timeout} s") from None

    def close(self) -> None:
        if not self._loop.is_running():
            return
        # cancelled tasks finish their cleanup in moments; a task that ignores cancellation must not
        # keep the caller's process from exiting
        self.run(_cancel_remaining_tasks(), timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)
        self._loop.close()


async def _cancel_remaining_tasks() -> None:
    current = asyncio.current_task()
    tasks = [task for task in asyncio.all_tasks() if task is not current]
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def shutdown_signal() -> Iterator[asyncio.Future[str]]:
    """A future that gets the signal's name on SIGINT or SIGTERM, for long-running commands.

    Enter it before announcing readiness, so a signal sent right after never hits the default handler.
    """
    import signal

    loop = asyncio.get_running_loop()
    received: asyncio.Future[str] = loop.create_future()
    signals = (signal.SIGINT, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, lambda sig=sig: received.done() or received.set_result(sig.name))
    try:
        yield received
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def configure_logging(level: int = 30) -> None:
    """Plain one-line logs on stderr at ``level``; hivemind's (and p2pd's) own logs no louder than WARNING
    unless debugging, so a terminal shows what matters."""
    import logging

    from swarmgrad.after_import import after_import

    def route_hivemind() -> None:
        from hivemind.utils.logging import use_hivemind_log_handler

        use_hivemind_log_handler("nowhere")  # hivemind's records go through the root logger like ours
        logging.getLogger("hivemind").setLevel(level if level <= logging.DEBUG else max(level, logging.WARNING))

    logging.basicConfig(level=level, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s", force=True)
    after_import("hivemind.utils.logging", route_hivemind)  # not before: importing hivemind loads torch
