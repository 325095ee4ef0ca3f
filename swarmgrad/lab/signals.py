"""Signal handling for an open lab: SIGTERM/SIGHUP unwind it like Ctrl-C, and nothing interrupts its teardown.

:func:`terminate_on_signals` makes SIGTERM and SIGHUP raise :class:`LabTerminated` (a
KeyboardInterrupt) in the main thread, so ``with`` blocks unwind and clean up;
:class:`DeferredSignals` holds signals while a teardown runs and delivers them afterwards.
"""

from __future__ import annotations

import signal
import threading
from typing import Any


class LabTerminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived while a lab was open; raised so that ``with`` blocks unwind."""

    def __init__(self, signum: int):
        super().__init__(f"terminated by {signal.Signals(signum).name}")
        self.signum = signum
        self.exit_code = 128 + signum


def terminate_on_signals() -> dict[int, Any]:
    """Make SIGTERM and SIGHUP raise :class:`LabTerminated`; returns the handlers they replaced, for
    :func:`restore_handlers`. Does nothing (returns ``{}``) outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        return {}

    raised = False

    def terminate(signum: int, _frame: object) -> None:
        # Once only: a second SIGTERM while the first unwinds towards __exit__ must not abort
        # the teardown before it starts (close() holds signals itself once it runs).
        nonlocal raised
        if not raised:
            raised = True
            raise LabTerminated(signum)

    saved: dict[int, Any] = {}
    for signum in (signal.SIGTERM, signal.SIGHUP):
        saved[signum] = signal.signal(signum, terminate)
    return saved


def restore_handlers(saved: dict[int, Any]) -> None:
    """Put back the handlers ``saved`` maps each signal to (the default where there was none from Python)."""
    for signum, handler in saved.items():
        signal.signal(signum, handler if handler is not None else signal.SIG_DFL)


class DeferredSignals:
    """Holds SIGINT/SIGTERM/SIGHUP during teardown (a second Ctrl-C must not abandon it half done),
    then delivers them again once the caller's own handlers are back."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

    def __init__(self) -> None:
        self.pending: list[int] = []
        self.saved: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            self.saved = {s: signal.signal(s, self._hold) for s in self.SIGNALS}

    def _hold(self, signum: int, _frame: object) -> None:
        if signum not in self.pending:
            self.pending.append(signum)

    def restore(self) -> None:
        restore_handlers(self.saved)
        self.saved = {}

    def redeliver(self) -> None:
        for signum in self.pending:
            signal.raise_signal(signum)


__all__ = ["DeferredSignals", "LabTerminated", "restore_handlers", "terminate_on_signals"]
