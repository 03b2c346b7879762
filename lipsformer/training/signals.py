"""Graceful stop on SIGTERM / SIGINT: the loop saves a checkpoint at the next update and exits cleanly.

Clusters preempt jobs with SIGTERM and a grace period; Ctrl-C sends SIGINT. The first signal only sets a flag that
the loop polls after every optimizer update, between epochs and between evaluation batches (agreed across processes,
so every process stops at the same point), so the checkpoint is consistent and an evaluation is cut short. A second
SIGTERM changes nothing (the save under way finishes); a second Ctrl-C aborts at once without saving (train.py exits
130; every checkpoint already saved stays whole). Data loader workers ignore both signals and leave them to the main
process.

Under torchrun (``accelerate launch --multi_gpu``) a terminal's Ctrl-C reaches each process twice: from the terminal,
to the whole process group, and from the launcher, which passes it on. A second SIGINT within
:data:`LAUNCHER_ECHO_S` of the first is taken for that echo, not for a second Ctrl-C.
"""
import logging
import os
import signal
import threading
import time
from types import FrameType

_logger = logging.getLogger(__name__)

LAUNCHER_ECHO_S = 1.0  # a launcher passes a Ctrl-C on within milliseconds; a person presses twice more slowly


class SecondInterrupt(KeyboardInterrupt):
    """A second Ctrl-C while a stop is already under way: abort without saving."""


class StopSignal:
    """Records a SIGTERM / SIGINT while installed (use as a context manager)."""

    def __init__(self) -> None:
        self.received: str | None = None
        self._received_at = 0.0
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.received is not None

    def __enter__(self) -> 'StopSignal':
        if threading.current_thread() is threading.main_thread():  # handlers can only be set there
            for signum in (signal.SIGTERM, signal.SIGINT):
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        if self.received is not None:
            if signum == signal.SIGINT and _under_torchrun() and time.monotonic() - self._received_at < LAUNCHER_ECHO_S:
                return  # the launcher passing on the Ctrl-C that this process got from the terminal too
            if signum == signal.SIGINT:
                raise SecondInterrupt
            _logger.warning('received %s again: already stopping after saving a checkpoint (Ctrl-C aborts without '
                            'saving)', name)
            return
        self.received = name
        self._received_at = time.monotonic()
        _logger.warning('received %s: saving a checkpoint after the current update, then exiting '
                        '(press Ctrl-C again to abort without saving)', self.received)


def _under_torchrun() -> bool:
    """Whether torchrun's agent started this process (it passes a terminal's Ctrl-C on to its processes)."""
    return 'TORCHELASTIC_RUN_ID' in os.environ


def ignore_stop_signals(worker_id: int) -> None:
    """Loader workers leave SIGTERM / SIGINT to the main process, which saves a checkpoint before stopping them.

    A cluster preempting a job signals every process in it; a worker that died of it would end the run before the
    checkpoint is written.
    """
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
