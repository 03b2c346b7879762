"""Ctrl-C as a terminal sends it (SIGINT to the command's whole process group) to lipsformer-benchmark and
lipsformer-lipschitz while they run: exit 130, one line saying what was kept, no traceback, no process left behind."""
import json
import os
import sys

from process_support import child_processes, ctrl_c_when
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN

# A model outside timm whose steps wait where the test needs the run to stay: in the peak-memory process, and, once the
# first mode's report is written, in every training step.
_SLOW_MODEL = '''
import multiprocessing
import os
import time

from torch import nn

REPORT = {report!r}


class Slow(nn.Sequential):
    def forward(self, x):
        if self.training and os.path.exists(REPORT):
            time.sleep(600)
        return super().forward(x)


def make():
    if multiprocessing.parent_process() is not None:
        time.sleep(600)
    return Slow(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 10))
'''


def _benchmark(tmp_path, *extra):
    report = tmp_path / 'report.json'
    (tmp_path / 'slow.py').write_text(_SLOW_MODEL.format(report=str(report)))
    command = [sys.executable, '-m', 'lipsformer.instruments.benchmark', '--models', f'file:{tmp_path}/slow.py:make',
               '--mode', 'infer,train', '--batch-size', '2', '--img-size', '16', '--warmup', '0', '--repeats', '2',
               '--threads', '1', '--json', str(report), *extra]
    return command, report


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_benchmark_ctrl_c_while_the_peak_memory_process_starts(tmp_path):
    """The peak-memory child runs in a session of its own, out of the terminal's reach: a Ctrl-C while it imports
    torch ends the benchmark with its one line, no traceback of the child's, and the benchmark ends the child rather
    than wait for it."""
    command, report = _benchmark(tmp_path)
    children, sessions = [], []

    def memory_process_started(group: int) -> bool:
        children[:] = [pid for pid, line in child_processes(group).items() if '_fresh_process_main' in line]
        sessions.extend(os.getsid(pid) for pid in children)
        return bool(children)
    ended = ctrl_c_when(command, memory_process_started)
    assert ended.returncode == 130, ended.stderr
    assert 'Traceback' not in ended.stderr and 'KeyboardInterrupt' not in ended.stderr, ended.stderr
    assert ended.stderr.splitlines()[-1] == ('python -m lipsformer.instruments.benchmark: interrupted by Ctrl-C: no '
                                             'mode had finished; nothing was written')
    assert not report.exists() and not any(_alive(pid) for pid in children)
    assert sessions == children  # each a session's leader: no terminal's Ctrl-C reaches it


def test_benchmark_ctrl_c_keeps_the_finished_modes(tmp_path):
    command, report = _benchmark(tmp_path, '--no-memory')
    ended = ctrl_c_when(command, report)
    assert ended.returncode == 130 and 'Traceback' not in ended.stderr, ended.stderr
    assert ended.stderr.splitlines()[-1] == (f'python -m lipsformer.instruments.benchmark: interrupted by Ctrl-C: the '
                                             f'report so far (infer; complete false) is in --json {str(report)!r}')
    saved = json.loads(report.read_text())
    assert saved['complete'] is False and [row['mode'] for row in saved['results']] == ['infer']


def test_lipschitz_ctrl_c_during_the_estimates_keeps_the_bounds(tmp_path):
    report = tmp_path / 'sub' / 'report.json'  # written, complete false, once the bounds are computed
    kwargs = [f'{key}={",".join(map(str, value)) if isinstance(value, tuple) else value}'
              for key, value in SMALLEST_SWIN.items() if key != 'img_size']
    command = [sys.executable, '-m', 'lipsformer.lipschitz', '--model', SMALLEST_MODEL, '--img-size',
               str(SMALLEST_SWIN['img_size']), '--model-kwargs', *kwargs, '--iterations', '1000000', '--threads', '1',
               '--json', str(report)]
    ended = ctrl_c_when(command, report)
    assert ended.returncode == 130 and 'Traceback' not in ended.stderr, ended.stderr
    assert ended.stderr.splitlines()[-1] == (
        f'python -m lipsformer.lipschitz: interrupted by Ctrl-C during the empirical estimates: the bounds are printed '
        f'above and in --json {str(report)!r} (complete false)')
    assert 'Theorem 2 product bound' in ended.stdout
    saved = json.loads(report.read_text())
    assert saved['complete'] is False and 'empirical_lipschitz' not in saved and saved['branches']

