"""One run per run folder: a second start on a folder whose run is alive (a relaunch, a requeued job, a second
``--resume auto``) is refused with exit 2 naming the holder, and changes none of the live run's files, whether it comes
at the same instant, during a save or during an evaluation; a dead holder's lock is taken over.

The live run is a train.py subprocess that stops at a named point (``PAUSED <point>``) until the test puts a file of
that name into its release folder, so every overlap happens at the point named, without timing guesses."""
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest
from process_support import hold_lock, subprocess_env
from training_support import tiny_overrides

import lipsformer.training.run_lock as run_lock
from lipsformer.training.run_lock import LOCK_FILE, RunFolderInUseError, RunLock
from lipsformer.training.train_command import main

pytestmark = pytest.mark.usefixtures('one_thread')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train.py, stopping at the points named in PAUSE_AT (save: while the first checkpoint's optimizer.pt is written;
# eval: at the first evaluation) until the file of that name is in the folder RELEASE names.
_PAUSING_DRIVER = '''
import os, runpy, sys, time
import lipsformer.training.train_state as train_state
import lipsformer.training.trainer as trainer
points, release, done = os.environ['PAUSE_AT'].split(','), os.environ['RELEASE'], set()
def pause(point):
    if point not in points or point in done:
        return
    done.add(point)
    print(f'PAUSED {point}', flush=True)
    deadline = time.monotonic() + 180
    while not os.path.exists(os.path.join(release, point)) and time.monotonic() < deadline:
        time.sleep(0.05)
write = train_state.save_torch
def pausing_write(obj, path):
    if path.endswith(os.path.join('.tmp-epoch_0001', 'optimizer.pt')):
        pause('save')
    write(obj, path)
train_state.save_torch = pausing_write
validate = trainer.validate
def pausing_validate(*args, **kwargs):
    pause('eval')
    return validate(*args, **kwargs)
trainer.validate = pausing_validate
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''


class Run:
    """A train.py subprocess whose output is read as it comes."""

    def __init__(self, tmp_path, run_dir: str, data_dir: str, pause_at: str, *extra: str):
        driver = tmp_path / 'pausing_driver.py'
        driver.write_text(_PAUSING_DRIVER)
        self.release = tmp_path / f'release-{id(self)}'
        self.release.mkdir()
        self.process = subprocess.Popen(
            [sys.executable, str(driver), '--output', run_dir, *extra, *_overrides(data_dir)], cwd=REPO,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=subprocess_env(PAUSE_AT=pause_at, RELEASE=str(self.release)))
        self.lines: list[str] = []
        self._reader = threading.Thread(target=lambda: self.lines.extend(self.process.stdout), daemon=True)
        self._reader.start()

    @property
    def output(self) -> str:
        return ''.join(self.lines)

    def paused_at(self, point: str) -> bool:
        return f'PAUSED {point}\n' in self.lines

    def resume(self, point: str) -> None:
        (self.release / point).touch()

    def finish(self) -> int:
        for point in ('save', 'eval'):
            self.resume(point)
        code = self.process.wait(timeout=300)
        self._reader.join(timeout=30)
        return code


def _overrides(data_dir: str) -> list[str]:
    return tiny_overrides(data_dir, **{'checkpoint.export': False})


def _wait(condition, what: str, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f'{what}: not within {timeout} s')
        time.sleep(0.05)


def _snapshot(run_dir: str) -> dict[str, str]:
    """Every file and folder of the run folder with its content's hash."""
    found = {}
    for folder, folders, files in os.walk(run_dir):
        for name in folders:
            found[os.path.relpath(os.path.join(folder, name), run_dir) + '/'] = ''
        for name in files:
            path = os.path.join(folder, name)
            with open(path, 'rb') as f:
                found[os.path.relpath(path, run_dir)] = hashlib.sha256(f.read()).hexdigest()
    return found


def _epochs(run_dir: str) -> list[int]:
    return [json.loads(line)['epoch'] for line in open(os.path.join(run_dir, 'metrics.jsonl'))]


def test_a_second_start_at_once_during_a_save_or_during_an_evaluation_is_refused_and_changes_nothing(
        data_dir, tmp_path, caplog):
    """Two `--resume auto` starts of one folder at the same instant (a SLURM requeue racing the old job): the first to
    lock trains, the other is refused naming it. Then relaunches (a new start, `--resume auto`) while the live run
    writes its first checkpoint and while it evaluates: each refused with exit 2, the folder exactly as it was, and
    the live run ends as if alone."""
    run_dir = str(tmp_path / 'run')
    runs = [Run(tmp_path, run_dir, data_dir, 'save,eval', '--resume', 'auto') for _ in range(2)]
    try:
        _wait(lambda: any(run.process.poll() is not None for run in runs) or all(run.paused_at('save') for run in runs),
              'one of two simultaneous starts refused')
        assert not all(run.paused_at('save') for run in runs), 'both runs train in the same folder'
        refused, live = sorted(runs, key=lambda run: run.process.poll() is None)
        assert refused.finish() == 2, refused.output
        holder = f'is in use by process {live.process.pid} on host {socket.gethostname()}'
        assert holder in refused.output and refused.output.strip().splitlines()[-1].endswith('(exit 2)')
        for point in ('save', 'eval'):
            _wait(lambda: live.paused_at(point) or live.process.poll() is not None, f'the live run reaching {point}')
            assert live.paused_at(point), live.output
            before = _snapshot(run_dir)
            assert any(name.startswith(os.path.join('checkpoints', '.tmp-epoch_0001' if point == 'save' else
                                                    'epoch_0001')) for name in before)
            for relaunch in ([], ['--resume', 'auto']):
                caplog.clear()
                with caplog.at_level(logging.ERROR):
                    assert main(['--output', run_dir, *relaunch, *_overrides(data_dir)]) == 2
                assert holder in caplog.text and 'SECONDS waits for the folder' in caplog.text
                assert _snapshot(run_dir) == before, f'a start at {point} {relaunch} changed the run folder'
            live.resume(point)
    finally:
        codes = [run.finish() for run in runs]
    assert codes == [0, 2] or codes == [2, 0], ''.join(run.output for run in runs)
    assert _epochs(run_dir) == [1, 2]  # once each: one run wrote the folder
    assert json.load(open(os.path.join(run_dir, 'summary.json')))['status'] == 'finished'


def test_a_dead_holders_lock_is_taken_over_and_said(tmp_path, caplog):
    run_dir = str(tmp_path / 'run')
    holder = hold_lock(run_dir, str(tmp_path / 'never'))
    with pytest.raises(RunFolderInUseError, match=f'in use by process {holder.pid} on host'):
        RunLock(run_dir).acquire()
    holder.send_signal(signal.SIGKILL)  # a kill -9, or a node that died: the kernel drops its flock
    holder.wait(timeout=60)
    with caplog.at_level(logging.INFO), RunLock(run_dir) as lock:
        assert json.load(open(lock.path))['pid'] == os.getpid()
    assert f'taking over the lock of process {holder.pid} on host {socket.gethostname()}' in caplog.text
    assert open(os.path.join(run_dir, LOCK_FILE)).read() == ''  # released: nobody named


def test_a_lock_file_that_is_a_symbolic_link_is_refused_and_its_target_kept(data_dir, tmp_path, caplog):
    """The lock was opened through the link and the holder's name written over the file it pointed to."""
    run_dir, target = tmp_path / 'run', tmp_path / 'notes.txt'
    run_dir.mkdir()
    target.write_text('results of another run\n')
    os.symlink(target, run_dir / LOCK_FILE)
    with pytest.raises(RunFolderInUseError, match='is a symbolic link'):
        RunLock(str(run_dir)).acquire()
    assert main([*tiny_overrides(data_dir), '--output', str(run_dir)]) == 2
    assert f'{run_dir / LOCK_FILE} is a symbolic link' in caplog.records[-1].getMessage()
    assert f'rm {run_dir / LOCK_FILE}' in caplog.records[-1].getMessage()
    assert target.read_text() == 'results of another run\n' and os.listdir(run_dir) == [LOCK_FILE]


# Takes the run folder's lock as a run does, starts a DataLoader worker (forked, as on Linux by default), prints the
# worker's pid and waits to be killed.
_HOLDER_WITH_LOADER_WORKER = """
import sys, time
import torch
from lipsformer.training.run_lock import RunLock
RunLock(sys.argv[1]).acquire()
loader = iter(torch.utils.data.DataLoader(torch.arange(100), num_workers=1, prefetch_factor=1))
next(loader)
print(loader._workers[0].pid, flush=True)
time.sleep(600)
"""


def test_a_stopped_loader_worker_of_a_killed_run_does_not_hold_its_lock(tmp_path):
    """kill -9 of a run's main process, then a start at once: its loader workers (forked with every descriptor) must
    not keep the folder locked, not even one that is stopped and so never notices its parent died."""
    run_dir = str(tmp_path / 'run')
    holder = subprocess.Popen([sys.executable, '-c', _HOLDER_WITH_LOADER_WORKER, run_dir], stdout=subprocess.PIPE,
                              text=True, env=subprocess_env())
    worker = int(holder.stdout.readline())
    try:
        os.kill(worker, signal.SIGSTOP)
        with pytest.raises(RunFolderInUseError, match=f'in use by process {holder.pid} on host'):
            RunLock(run_dir).acquire()
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=60)
        with RunLock(run_dir) as lock:
            assert json.load(open(lock.path))['pid'] == os.getpid()
    finally:
        os.kill(worker, signal.SIGKILL)
        os.kill(worker, signal.SIGCONT)


def test_a_start_waits_for_the_holder_when_asked(tmp_path, caplog):
    run_dir, release = str(tmp_path / 'run'), str(tmp_path / 'release')
    holder = hold_lock(run_dir, release)
    timer = threading.Timer(1.0, lambda: open(release, 'w').close())
    timer.start()
    with caplog.at_level(logging.INFO), RunLock(run_dir, wait_s=120):
        pass
    holder.wait(timeout=60)
    assert f'is in use by process {holder.pid}' in caplog.text and 'waiting up to 120 s for it to end' in caplog.text
    holder = hold_lock(run_dir, release + '-again')
    try:
        with pytest.raises(RunFolderInUseError):  # a wait that ends first is a refusal
            RunLock(run_dir, wait_s=0.3).acquire()
    finally:
        open(release + '-again', 'w').close()
        holder.wait(timeout=60)


def test_without_flock_the_lock_file_s_process_decides(tmp_path, monkeypatch, caplog):
    """On a file system without flock, a holder alive on this host keeps the folder (the message says how to free a
    stale one), a dead one's is taken over, and a warning says the folder is guarded by the pid only."""
    def no_flock(fd, operation):
        raise OSError(37, 'No locks available')  # ENOLCK, as NFS without a lock daemon answers
    monkeypatch.setattr(run_lock.fcntl, 'flock', no_flock)
    run_dir = tmp_path / 'run'
    alive = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])
    try:
        with RunLock(str(run_dir)) as lock:  # writes this process's details
            holder = json.load(open(lock.path))
        holder.update(pid=alive.pid, process_start=run_lock._process_start(alive.pid))
        (run_dir / LOCK_FILE).write_text(json.dumps(holder))
        with pytest.raises(RunFolderInUseError, match=f'process {alive.pid} .*remove {run_dir / LOCK_FILE}'):
            RunLock(str(run_dir)).acquire()
    finally:
        alive.kill()
        alive.wait()
    with caplog.at_level(logging.INFO), RunLock(str(run_dir)):
        pass
    assert 'does not support flock (No locks available); the run folder is guarded only by the process id' in \
        caplog.text
    assert f'taking over the lock of process {alive.pid}' in caplog.text
