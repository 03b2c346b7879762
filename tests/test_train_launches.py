"""Two CPU processes as launchers start them, and how their run ends: a launch that asked for two processes and got
one says so with the line that starts two; a process killed mid-run (kill -9) is named by the survivor as another
process of the run that died, exit 6, in the console and in train.log; a resume refused under ``accelerate launch`` is
said once (by the main process), in train.log too; Ctrl-C to the launcher's process group stops the run with its
checkpoint, which summary.json and train.log say whatever the launcher's own exit status."""
import json
import os
import signal
import subprocess
import sys

import pytest
from process_support import ctrl_c_when, free_port, subprocess_env
from training_support import tiny_overrides

import lipsformer.training.signals as signals
from lipsformer.training.train_command import EXIT_PROCESS_DIED, main

pytestmark = pytest.mark.usefixtures('one_thread', 'probe_model')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# train.py's main() with the probe model registered with timm (it signals its own process on cue: SIGNAL_PROBE).
_DRIVER = '''
import runpy, sys
import probe_models
probe_models.register_probe_model()
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''

TWO_CPU_PROCESSES = ['--multi_gpu', '--num_processes', '2']  # with ACCELERATE_USE_CPU=1


def _command(tmp_path, run_dir: str, launch: list[str], *args: str) -> list[str]:
    driver = tmp_path / 'driver.py'
    driver.write_text(_DRIVER)
    return [sys.executable, '-m', 'accelerate.commands.launch', *launch, '--num_machines', '1', '--mixed_precision',
            'no', '--dynamo_backend', 'no', '--main_process_port', str(free_port()), str(driver), '--output', run_dir,
            *args]


def _launch(tmp_path, run_dir: str, launch: list[str], *args: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(_command(tmp_path, run_dir, launch, *args), cwd=REPO, capture_output=True, text=True,
                          timeout=180, env=subprocess_env(**env))


def _probe(data_dir: str, **extra) -> list[str]:
    return tiny_overrides(data_dir, **{'model.name': 'nan_probe_net', 'model.kwargs': '{}', 'checkpoint.export': False,
                                       **extra})


def _errors(text: str) -> list[str]:
    return [line for line in text.splitlines() if ' ERROR lipsformer.' in line]


def test_accelerate_launch_cpu_with_two_processes_says_it_started_one(data_dir, tmp_path):
    """``accelerate launch --num_processes 2 --cpu`` starts one process in Accelerate 1.x: it trains alone, and the
    log and summary.json say so with the launch line that starts two."""
    run_dir = str(tmp_path / 'run')
    ended = _launch(tmp_path, run_dir, ['--num_processes', '2', '--cpu'], *_probe(data_dir, **{'train.epochs': 1}))
    assert ended.returncode == 0, ended.stderr[-3000:]
    distributed = json.load(open(os.path.join(run_dir, 'summary.json')))['distributed']
    assert distributed['processes'] == 1
    assert distributed['note'].startswith('the launcher was asked for 2 processes but started this one alone '
                                          '(accelerate launch --cpu starts a single process in Accelerate 1.x): the '
                                          'run trains in one process. To train as 2 CPU processes: '
                                          'ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2 '
                                          'train.py --output')
    log = open(os.path.join(run_dir, 'train.log')).read()
    assert 'WARNING lipsformer.training.trainer: the launcher was asked for 2 processes' in log


@pytest.mark.parametrize('killed', [1, 0])
def test_a_process_killed_mid_run_is_named_by_the_other_in_the_console_and_train_log(data_dir, tmp_path, killed):
    run_dir = str(tmp_path / 'run')
    ended = _launch(tmp_path, run_dir, TWO_CPU_PROCESSES, *_probe(data_dir, **{'train.epochs': 3}),
                    ACCELERATE_USE_CPU='1', SIGNAL_PROBE='train:8:SIGKILL', SIGNAL_PROBE_RANK=str(killed))
    survivor = 1 - killed
    reasons = _errors(ended.stderr)
    assert len(reasons) == 1, ended.stderr[-5000:]
    said = ('' if survivor == 0 else 'process 1: ') + (
        f'PeerProcessDiedError: another process of the run died (process {killed}; this is process {survivor} of 2): '
        f'its connection closed during a collective operation (')
    assert said in reasons[0] and 'unexpected error' not in ended.stderr
    checkpoint = os.path.join(run_dir, 'checkpoints', 'epoch_0002')  # 3 updates an epoch: call 8 is in epoch 3
    assert f'the last checkpoint saved is {checkpoint}, every checkpoint saved is whole' in reasons[0]
    assert reasons[0].endswith(f'(exit {EXIT_PROCESS_DIED})')
    assert reasons[0].split(' ', 1)[1] in open(os.path.join(run_dir, 'train.log')).read()


def test_a_resume_refused_under_accelerate_launch_is_said_once_and_in_train_log(data_dir, tmp_path):
    run_dir = str(tmp_path / 'run')
    assert main(['--output', run_dir, *_probe(data_dir, **{'train.epochs': 1})]) == 0
    ended = _launch(tmp_path, run_dir, TWO_CPU_PROCESSES, '--resume', 'auto',
                    *_probe(data_dir, **{'train.epochs': 2, 'model.name': 'lipsformer_swin_tiny',
                                         'model.kwargs': tiny_overrides(data_dir)[1].partition('=')[2]}),
                    ACCELERATE_USE_CPU='1')
    assert ended.returncode != 0
    reasons = _errors(ended.stderr)
    assert len(reasons) == 1 and 'CheckpointError: ' in reasons[0] and reasons[0].endswith('(exit 2)'), \
        ended.stderr[-5000:]
    assert 'process 1:' not in reasons[0]
    log = open(os.path.join(run_dir, 'train.log')).read()
    assert reasons[0].split(' ', 1)[1] in log


def test_ctrl_c_to_the_launcher_s_group_stops_the_run_with_its_checkpoint(data_dir, tmp_path):
    """A terminal's Ctrl-C reaches the launcher and both processes (torchrun passes it on too): the run stops after
    saving, says so in train.log and summary.json, and no process reports an error; the launcher's own exit status is
    torchrun's (1, with its SignalException), which docs/training.md says."""
    run_dir = str(tmp_path / 'run')
    command = _command(tmp_path, run_dir, TWO_CPU_PROCESSES, *_probe(data_dir, **{'train.epochs': 200}))
    os.environ['ACCELERATE_USE_CPU'] = '1'
    try:
        ended = ctrl_c_when(command, os.path.join(run_dir, 'checkpoints', 'epoch_0001', 'meta.json'), timeout_s=120)
    finally:
        del os.environ['ACCELERATE_USE_CPU']
    assert not _errors(ended.stderr), ended.stderr[-5000:]
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['status'] == 'stopped' and summary['ranks_identical']
    assert 'stopped by SIGINT' in open(os.path.join(run_dir, 'train.log')).read()
    assert ended.returncode == 1  # torchrun's, whatever the processes' own: docs/training.md


def test_a_ctrl_c_that_torchrun_passes_on_is_not_a_second_one(monkeypatch):
    """The terminal's SIGINT and the launcher's copy of it arrive milliseconds apart: one Ctrl-C, a stop with a
    checkpoint; a second SIGINT later aborts as in a single process."""
    monkeypatch.setenv('TORCHELASTIC_RUN_ID', 'test')
    stop = signals.StopSignal()
    stop._handle(signal.SIGINT, None)
    stop._handle(signal.SIGINT, None)  # the launcher's copy
    assert stop.received == 'SIGINT'
    monkeypatch.setattr(signals, 'LAUNCHER_ECHO_S', 0.0)
    with pytest.raises(signals.SecondInterrupt):
        stop._handle(signal.SIGINT, None)
