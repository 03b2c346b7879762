"""A run folder removed (``rm -rf``) or robbed of its lock while its run trains: the run notices at its next log line
or checkpoint, saves what it holds into the folder made again (under a lock of its own), and stops with exit 5 and a
message naming that checkpoint, in the console and in the new train.log; ``--resume auto`` continues from it. The
run never finishes into a folder made again as if nothing had happened."""
import json
import os
import shutil
import subprocess
import sys
import time

import pytest
from process_support import subprocess_env
from training_support import tiny_overrides

from lipsformer.training.run_lock import LOCK_FILE, RunLock
from lipsformer.training.train_command import EXIT_RUN_FOLDER_GONE, main
from lipsformer.training.train_state import read_meta

pytestmark = pytest.mark.usefixtures('one_thread')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _train_until(run_dir: str, data_dir: str, ready: str, remove) -> subprocess.CompletedProcess:
    """Start a 40-epoch train.py, call ``remove()`` once ``ready`` (a path in the run folder) exists, and wait."""
    command = [sys.executable, 'train.py', '--output', run_dir, *tiny_overrides(data_dir, **{'train.epochs': 40})]
    process = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               env=subprocess_env())
    try:
        deadline = time.monotonic() + 120
        while not os.path.exists(ready):
            assert process.poll() is None, process.communicate()[1][-3000:]
            assert time.monotonic() < deadline, 'the run saved no checkpoint in 120 s'
            time.sleep(0.02)
        remove()
        stdout, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)


def test_a_run_folder_removed_while_training_stops_the_run_with_its_state_saved(data_dir, tmp_path):
    """The folder disappears in one instant, as at the end of ``rm -rf`` (it is renamed away first, so that the removal
    cannot race with the run's own rescue into the folder made again)."""
    run_dir = str(tmp_path / 'run')

    def rm_rf() -> None:
        os.rename(run_dir, tmp_path / 'trash')
        subprocess.run(['rm', '-rf', str(tmp_path / 'trash')], check=True)
    ended = _train_until(run_dir, data_dir, os.path.join(run_dir, 'checkpoints', 'epoch_0001', 'meta.json'), rm_rf)
    assert ended.returncode == EXIT_RUN_FOLDER_GONE == 5, ended.stderr[-3000:]
    reason = ended.stderr.strip().splitlines()[-1]
    assert f"RunFolderGoneError: the run folder '{run_dir}' was removed while the run trained" in reason
    saved = reason.split('The state it held in memory is saved in ')[1].split(' ')[0]
    assert os.path.dirname(saved) == os.path.join(run_dir, 'checkpoints')
    assert f'--config {run_dir}/config.yaml --output {run_dir} --resume auto' in reason and reason.endswith('(exit 5)')
    assert read_meta(saved)['progress']['step'] >= 6  # at least the first epoch, trained again into nothing
    assert os.path.isfile(os.path.join(run_dir, 'config.yaml'))
    assert not os.path.exists(os.path.join(run_dir, 'summary.json'))  # never finished into the new folder
    assert reason.split(' ', 1)[1] in open(os.path.join(run_dir, 'train.log')).read()
    epochs = read_meta(saved)['progress']['epoch']
    assert main(['--config', os.path.join(run_dir, 'config.yaml'), '--output', run_dir, '--resume', 'auto',
                 f'train.epochs={epochs + 1}']) == 0
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['status'] == 'finished' and summary['epochs_done'] == epochs + 1


def test_a_lock_file_removed_while_training_stops_the_run_in_its_folder(data_dir, tmp_path):
    """Without its lock a second start could take the folder: the run keeps its state there, under a new lock."""
    run_dir = str(tmp_path / 'run')
    first = os.path.join(run_dir, 'checkpoints', 'epoch_0001')
    ended = _train_until(run_dir, data_dir, os.path.join(first, 'meta.json'),
                         lambda: os.remove(os.path.join(run_dir, LOCK_FILE)))
    assert ended.returncode == 5, ended.stderr[-3000:]
    reason = ended.stderr.strip().splitlines()[-1]
    assert f"its lock file '{os.path.join(run_dir, LOCK_FILE)}' was removed while the run trained" in reason
    saved = reason.split('The state it held in memory is saved in ')[1].split(' ')[0]
    assert os.path.isdir(first) and os.path.isdir(saved)
    assert os.path.isfile(os.path.join(run_dir, LOCK_FILE))


def test_the_lock_says_what_became_of_its_file(tmp_path):
    run_dir = str(tmp_path / 'run')
    lock = RunLock(run_dir)
    lock.acquire()
    try:
        assert lock.lost() is None
        os.remove(lock.path)
        assert lock.lost() == f"its lock file '{lock.path}' was removed"
        open(lock.path, 'w').close()
        assert lock.lost() == f"the run folder '{run_dir}' was removed or replaced (its lock file is another file now)"
        shutil.rmtree(run_dir)
        assert lock.lost() == f"the run folder '{run_dir}' was removed"
    finally:
        lock.release()
