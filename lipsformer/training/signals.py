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

Once the loop has run, a SIGTERM no longer ends the process before it has said why it ended (:class:`HeldTermination`,
train.py's handler around the whole run): torchrun sends one to every other process as soon as one has failed, and
with the default action a survivor that had just seen its peer die would vanish without a word.
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
            if isinstance(self._previous[signal.SIGTERM], HeldTermination):
                self._previous[signal.SIGTERM].loop_started = True
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


class HeldTermination:
    """SIGTERM outside the training loop: what it did before (by default, end at once) until a loop has started, then
    held back until the process has reported how the run ended (use as a context manager around the run and its
    report).

    After the loop the process is already ending, on its own error or one another process caused; the report is its
    last line and nothing is left to save, so a launcher's or a cluster's SIGTERM only waits for it (their grace period
    is for that). The status the process exits with stays the reason's.
    """

    def __init__(self) -> None:
        self.loop_started = False
        self._previous: object = None

    def __enter__(self) -> 'HeldTermination':
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self)
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)
            self._previous = None

    def __call__(self, signum: int, frame: FrameType | None) -> None:
        if not self.loop_started:  # nothing to save or report yet: as without this handler
            if callable(self._previous):
                self._previous(signum, frame)
            elif self._previous != signal.SIG_IGN:
                signal.signal(signum, signal.SIG_DFL)
                os.kill(os.getpid(), signum)
            return
        _logger.warning('received %s while the run ends: exiting once the reason is reported',
                        signal.Signals(signum).name)


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
