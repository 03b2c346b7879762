"""One run per run folder: the main process holds ``<run>/.lock`` from before it cleans or reads anything there until
the run has ended.

The lock is an advisory ``flock`` on that file, which the kernel releases when its holder ends however it ends (a kill
-9, a node that reboots): a later start takes it over and says whose it was. A ``flock`` belongs to the open file, and
a forked child (a DataLoader worker) would share it and keep the folder locked after the holder died, until it
noticed (never, if it is stopped); so every child forked from the holder closes its copy of the descriptor at once.
The file also names its holder (host, pid, start time) for the message that refuses a second start. Where the file
system has no ``flock`` (some network and FUSE file systems), a warning says so and the file's contents decide: a
holder that still runs on this host keeps the folder; a dead one's is taken over; one on another host keeps it until
the file is removed.

The file is never replaced or removed (a lock on a replaced file would lock nothing): a holder rewrites its contents.
A holder checks now and then that its file is still the one at that path (:meth:`RunLock.lost`): a run folder removed
(``rm -rf``) or replaced while its run trains is noticed, and the run stops (:class:`RunFolderGoneError`) rather than
write into a folder nobody guards.
"""
import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import time
from typing import Any

__all__ = ['LOCK_FILE', 'RunFolderGoneError', 'RunFolderInUseError', 'RunLock']

_logger = logging.getLogger(__name__)

LOCK_FILE = '.lock'
_NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL)  # the file system cannot flock
_POLL_S = 1.0
_HELD: set[int] = set()  # descriptors of the locks this process holds, closed in every child it forks


def _close_held_in_child() -> None:
    for fd in _HELD:
        with contextlib.suppress(OSError):
            os.close(fd)
    _HELD.clear()


os.register_at_fork(after_in_child=_close_held_in_child)


class RunFolderInUseError(RuntimeError):
    """The run folder cannot be taken: another process holds it (the message names it: host, pid, since when), or its
    lock file is a symbolic link; the message says what to do.

    Attributes:
        holder: The holder alone, in words (``process PID on host HOST (since ...)``), where the refusal knows it.
    """

    def __init__(self, message: str, holder: str = 'another process') -> None:
        super().__init__(message)
        self.holder = holder


class RunFolderGoneError(RuntimeError):
    """The run folder, or its lock file, was removed or replaced while the run trained; the message says what was
    found, where the state the run held was saved (if it could be) and how to continue."""


class RunLock:
    """The run folder's lock (a context manager): :meth:`acquire` it before touching the folder.

    Args:
        run_dir: The run folder (created if needed).
        wait_s: How long to wait for another holder to end before refusing (0: refuse at once).
    """

    def __init__(self, run_dir: str, wait_s: float = 0.0):
        self.run_dir = run_dir
        self.path = os.path.join(run_dir, LOCK_FILE)
        self.wait_s = wait_s
        self._fd: int | None = None

    def __enter__(self) -> 'RunLock':
        self.acquire()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock, waiting up to ``wait_s`` for another holder to end.

        Raises:
            RunFolderInUseError: Another process holds it (still, after ``wait_s``).
        """
        os.makedirs(self.run_dir, exist_ok=True)
        # Not through a symbolic link: the holder's name would be written over the file it points to. 0o666 as open()
        # makes any file.
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o666)
        except OSError as e:
            if e.errno != errno.ELOOP:
                raise
            raise RunFolderInUseError(
                f'{self.path} is a symbolic link (to {os.readlink(self.path)!r}), not the run\'s lock file: taking '
                f'the lock would write over what it points to. Remove the link (rm {self.path}) and start again',
                holder='a symbolic link') from None
        _HELD.add(fd)  # before the lock is taken: a fork from another thread meanwhile must not inherit it
        try:
            previous = self._take(fd)
        except BaseException:
            _HELD.discard(fd)
            os.close(fd)
            raise
        self._fd = fd
        if previous and not _is_us(previous):
            _logger.info('%s: taking over the lock of %s, which has ended', self.path, _describe(previous))
        _write_holder(fd, _holder())

    def lost(self) -> str | None:
        """What became of the lock file since :meth:`acquire` (None while it is still there, the file this holder
        locked): the run folder or the file was removed, or another file took its place. One ``stat`` and one
        ``fstat``: cheap enough to call at every log line."""
        if self._fd is None:
            return None
        held = os.fstat(self._fd)
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            if not os.path.isdir(self.run_dir):
                return f'the run folder {os.path.abspath(self.run_dir)!r} was removed'
            return f'its lock file {os.path.abspath(self.path)!r} was removed'
        except OSError as e:
            return f'its lock file {os.path.abspath(self.path)!r} cannot be read ({e.strerror})'
        if (there.st_dev, there.st_ino) != (held.st_dev, held.st_ino) or held.st_nlink == 0:
            return (f'the run folder {os.path.abspath(self.run_dir)!r} was removed or replaced (its lock file is '
                    f'another file now)')
        return None

    def release(self) -> None:
        """Clear the holder's details and let the lock go (the file stays)."""
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            os.ftruncate(self._fd, 0)
        _HELD.discard(self._fd)
        os.close(self._fd)  # closing the only descriptor of the open file releases the flock
        self._fd = None

    def _take(self, fd: int) -> dict[str, Any] | None:
        """Lock ``fd``; returns the holder the file named before (None if nobody)."""
        deadline = time.monotonic() + self.wait_s
        said_waiting = pid_check_only = False
        while True:
            holder = _read_holder(fd)
            if not pid_check_only:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return holder
                except BlockingIOError:
                    holder = _read_holder(fd, settle=True)
                except OSError as e:
                    if e.errno not in _NO_FLOCK:
                        raise
                    _logger.warning('%s: the file system does not support flock (%s); the run folder is guarded '
                                    'only by the process id written in the lock file', self.path, e.strerror)
                    pid_check_only = True
            if pid_check_only and (holder is None or _is_us(holder) or not _alive(holder)):
                return holder
            if time.monotonic() >= deadline:
                raise RunFolderInUseError(self._refusal(holder, pid_check_only), _describe(holder))
            if not said_waiting:
                _logger.info('%s is in use by %s; waiting up to %.0f s for it to end', self.run_dir,
                             _describe(holder), self.wait_s)
                said_waiting = True
            time.sleep(min(_POLL_S, max(deadline - time.monotonic(), 0.0)))

    def _refusal(self, holder: dict[str, Any] | None, pid_check_only: bool) -> str:
        stale = (f' If that process no longer runs (this file system has no flock, so its lock outlives it), remove '
                 f'{self.path}.' if pid_check_only else '')
        return (f'the run folder {os.path.abspath(self.run_dir)!r} is in use by {_describe(holder)}: one run writes '
                f'a folder at a time. Wait for that run to end (or stop it: SIGTERM saves a checkpoint), then continue '
                f'it with --resume auto, or give another --output; --wait-for-lock SECONDS waits for the folder.'
                f'{stale}')


def _holder() -> dict[str, Any]:
    return dict(host=socket.gethostname(), pid=os.getpid(), process_start=_process_start(os.getpid()),
                since=time.strftime('%Y-%m-%d %H:%M:%S %z'))


def _describe(holder: dict[str, Any] | None) -> str:
    if not holder:
        return 'another process (it has not written its details yet)'
    return f'process {holder.get("pid")} on host {holder.get("host")} (since {holder.get("since")})'


def _is_us(holder: dict[str, Any]) -> bool:
    return holder.get('host') == socket.gethostname() and holder.get('pid') == os.getpid()


def _process_start(pid: int) -> int | None:
    """When process ``pid`` started, in clock ticks since boot (Linux), to tell it from a later one with its pid."""
    try:
        with open(f'/proc/{pid}/stat') as f:
            return int(f.read().rsplit(')', 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _alive(holder: dict[str, Any]) -> bool:
    """Whether the holder still runs, as far as this host can tell (one on another host is assumed to)."""
    if holder.get('host') != socket.gethostname():
        return True
    pid = holder.get('pid')
    if not isinstance(pid, int):
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    started = holder.get('process_start')
    return started is None or _process_start(pid) in (None, started)


def _read_holder(fd: int, settle: bool = False) -> dict[str, Any] | None:
    """The details in the lock file; with ``settle``, give a holder that has just taken it a moment to write them."""
    for attempt in range(20 if settle else 1):
        text = os.pread(fd, 4096, 0).decode('utf-8', errors='replace').strip()
        if text:
            try:
                holder = json.loads(text)
                return holder if isinstance(holder, dict) else None
            except json.JSONDecodeError:
                pass
        if attempt < 19 and settle:
            time.sleep(0.05)
    return None


def _write_holder(fd: int, holder: dict[str, Any]) -> None:
    data = (json.dumps(holder) + '\n').encode()
    os.ftruncate(fd, 0)
    os.pwrite(fd, data, 0)
    os.fsync(fd)
