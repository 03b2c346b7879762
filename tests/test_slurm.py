"""scripts/slurm_train.sh without SLURM: the time-limit signal stops training with a checkpoint, the job requeues
itself through (a fake) scontrol, and the next run continues with --resume auto to the end; a requeued job that starts
while the old one still holds the run folder waits for it."""
import json
import os
import signal
import stat
import subprocess
import sys
import time

from image_data import make_image_folder
from process_support import hold_lock, subprocess_env
from training_support import tiny_overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, 'scripts', 'slurm_train.sh')
EPOCHS = 12


def _fake_scontrol(folder) -> str:
    """An scontrol that records its arguments."""
    bin_dir = folder / 'bin'
    bin_dir.mkdir()
    log = folder / 'scontrol.log'
    scontrol = bin_dir / 'scontrol'
    scontrol.write_text(f'#!/bin/sh\necho "$@" >> {log}\n')
    scontrol.chmod(scontrol.stat().st_mode | stat.S_IEXEC)
    return str(bin_dir)


def _start(tmp_path, run_dir: str, data_dir: str, bin_dir: str, epochs: int = EPOCHS) -> subprocess.Popen:
    overrides = tiny_overrides(data_dir, **{'train.epochs': epochs, 'checkpoint.export': False})
    env = subprocess_env(LAUNCH='local', SLURM_JOB_ID='4242', SLURM_SUBMIT_DIR=REPO,
                         PATH=f'{bin_dir}:{os.path.dirname(sys.executable)}:{os.environ["PATH"]}')
    return subprocess.Popen(['bash', SCRIPT, 'quickstart', run_dir, *overrides], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


def _epochs_scored(run_dir: str) -> list[int]:
    path = os.path.join(run_dir, 'metrics.jsonl')
    if not os.path.isfile(path):
        return []
    return [json.loads(line)['epoch'] for line in open(path) if line.strip()]


def test_time_limit_signal_saves_requeues_and_the_next_run_resumes(tmp_path):
    data_dir = make_image_folder(str(tmp_path / 'data'))
    run_dir = str(tmp_path / 'run')
    bin_dir = _fake_scontrol(tmp_path)
    job = _start(tmp_path, run_dir, data_dir, bin_dir)
    deadline = time.time() + 120
    while not _epochs_scored(run_dir) and job.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    job.send_signal(signal.SIGUSR1)  # what #SBATCH --signal=B:USR1@300 sends the batch script
    output, _ = job.communicate(timeout=120)
    assert job.returncode == 0, output
    assert 'requeueing job 4242' in output
    assert (tmp_path / 'scontrol.log').read_text().split('\n')[0] == 'requeue 4242'
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['status'] == 'stopped' and summary['epochs_done'] < EPOCHS
    checkpoints = os.listdir(os.path.join(run_dir, 'checkpoints'))
    assert any(name.startswith(('epoch_', 'step_')) for name in checkpoints)
    stopped_at = summary['step']

    (tmp_path / 'scontrol.log').unlink()
    job = _start(tmp_path, run_dir, data_dir, bin_dir)  # the requeued job: same command
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, output
    assert not (tmp_path / 'scontrol.log').exists()  # no time limit this time: no requeue
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['status'] == 'finished' and summary['epochs_done'] == EPOCHS
    log = open(os.path.join(run_dir, 'train.log')).read()
    assert f'step {stopped_at}' in log.split('resumed from')[1].split('\n')[0]
    assert _epochs_scored(run_dir) == list(range(1, EPOCHS + 1))


def test_a_requeued_job_waits_for_the_old_job_to_let_the_run_folder_go(tmp_path):
    """The old job still holds the run folder when the requeued one starts (a requeue from outside, a node slow to
    die): the new one waits, saying for whom, and trains once the old one has let go."""
    data_dir = make_image_folder(str(tmp_path / 'data'))
    run_dir, release = str(tmp_path / 'run'), str(tmp_path / 'old-job-ended')
    old_job = hold_lock(run_dir, release)
    job = _start(tmp_path, run_dir, data_dir, _fake_scontrol(tmp_path), epochs=1)
    seen = []
    for line in job.stdout:
        seen.append(line)
        if 'waiting up to 900 s for it to end' in line:
            break
    assert f'is in use by process {old_job.pid}' in seen[-1], ''.join(seen)
    assert not os.path.exists(os.path.join(run_dir, 'checkpoints'))
    open(release, 'w').close()
    output, _ = job.communicate(timeout=300)
    assert job.returncode == 0, ''.join(seen) + output
    assert json.load(open(os.path.join(run_dir, 'summary.json')))['status'] == 'finished'
    assert old_job.wait(timeout=60) == 0
