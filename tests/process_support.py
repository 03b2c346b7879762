"""Processes in the tests: torch on one thread, the environment of a subprocess, a run folder's lock held by another
process, a free port for a launcher, a script run under Triton's interpreter, a command stopped by Ctrl-C."""
import contextlib
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import torch

from lipsformer.training import run_lock

RUN_LOCK_MODULE = run_lock.__file__


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread: the tiny test models are fastest that way, most of all on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a training subprocess: one thread, and this folder importable (before the ``PYTHONPATH`` the
    tests run with, which may name the checkout to test)."""
    path = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get('PYTHONPATH')]))
    return {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': path, **extra}


# Takes the lock (run_lock.py loaded on its own: no torch to import) and lets it go when the file argv[3] exists.
_HOLDER = '''
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location('run_lock', sys.argv[1])
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
lock = run_lock.RunLock(sys.argv[2])
lock.acquire()
print('HELD', flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
lock.release()
'''


def hold_lock(run_dir: str, release: str) -> subprocess.Popen:
    """A process that takes the run folder's lock (as a run does) and lets it go when the file ``release`` exists."""
    holder = subprocess.Popen([sys.executable, '-c', _HOLDER, RUN_LOCK_MODULE, run_dir, release],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert holder.stdout.readline() == 'HELD\n'
    return holder


def free_port() -> int:
    """A free local TCP port for ``accelerate launch --main_process_port`` (port 0 hangs torch 2.6's rendezvous)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def assert_runs_under_triton_interpreter(script: str, timeout_s: float) -> None:
    """Run ``script`` in a fresh interpreter with ``TRITON_INTERPRET=1`` (which must be set before Triton is imported,
    so not in this process) and assert that it ends well and prints 'triton ok'."""
    result = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=timeout_s,
                            env={**os.environ, 'TRITON_INTERPRET': '1'})
    assert result.returncode == 0, result.stderr[-3000:]
    assert 'triton ok' in result.stdout


def child_processes(pid: int) -> dict[int, str]:
    """The processes whose parent is ``pid``, by pid, with their command lines (Linux's /proc)."""
    found = {}
    for entry in os.listdir('/proc'):
        try:
            if entry.isdigit():
                with open(f'/proc/{entry}/stat') as f:  # the command's name may hold spaces and ')': split after it
                    parent = int(f.read().rpartition(')')[2].split()[1])
                if parent == pid:
                    with open(f'/proc/{entry}/cmdline', 'rb') as f:
                        found[int(entry)] = f.read().replace(b'\0', b' ').decode(errors='replace')
        except (OSError, ValueError, IndexError):  # ended meanwhile
            continue
    return found


def ctrl_c_when(command: list[str], ready: str | os.PathLike | Callable[[int], bool],
                timeout_s: float = 300) -> subprocess.CompletedProcess:
    """Run ``command`` as a terminal runs a foreground job (a process group of its own), and once ``ready`` (a file
    exists, or a function of the group's id says so) press Ctrl-C: SIGINT to every process of the group, children
    included. Returns how the command ended (its output as text); fails if it ends before it is ready."""
    is_ready = ready if callable(ready) else lambda group: os.path.exists(ready)
    with tempfile.TemporaryFile('w+') as stdout, tempfile.TemporaryFile('w+') as stderr:
        process = subprocess.Popen(command, stdout=stdout, stderr=stderr, text=True, env=subprocess_env(),
                                   start_new_session=True)
        try:
            deadline = time.monotonic() + timeout_s
            while not is_ready(process.pid):
                if process.poll() is not None:  # the files' offset is the command's own until it ends
                    stderr.seek(0)
                    raise AssertionError(f'ended (exit {process.returncode}) before it was ready:\n{stderr.read()}')
                assert time.monotonic() < deadline, f'not ready after {timeout_s} s'
                time.sleep(0.02)
            os.killpg(process.pid, signal.SIGINT)
            process.wait(timeout=timeout_s)
        finally:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        stdout.seek(0)
        stderr.seek(0)
        return subprocess.CompletedProcess(command, process.returncode, stdout.read(), stderr.read())
