"""Stopping a run: SIGTERM and SIGINT at the moments that matter (on a periodic step, during a save, during an
evaluation, twice), and train.py's exit status for every way a run ends.

The signals are real ones, sent by the probe model to this process at a chosen forward call, or by a patched file
write in the middle of a save; the run's own handlers take them as they would a cluster's. Each stopped run is
continued and must end with the weights and metrics of the run that was never interrupted.
"""
import errno
import importlib.util
import io
import json
import logging
import os
import signal
import subprocess
import sys

import pytest
from probe_models import NAN_AT_CALLS, PROBE_CALLS, SIGNALS_AT_CALLS
from process_support import subprocess_env
from safetensors import SafetensorError
from training_support import assert_same_run, tiny_overrides

import lipsformer.training.train_state as train_state
import lipsformer.training.trainer as trainer
import lipsformer.utils.io as io_module
from lipsformer.training import load_config, train
from lipsformer.training.train_state import list_checkpoints, read_meta

pytestmark = pytest.mark.usefixtures('one_thread', 'probe_model')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATES_PER_EPOCH = 6  # 48 training images, batch 8; 24 validation images in 2 batches of 16


def _overrides(data_dir: str, **extra) -> list[str]:
    return tiny_overrides(data_dir, **{'model.name': 'nan_probe_net', 'model.kwargs': '{}',
                                       'checkpoint.export': False, 'checkpoint.keep_last': 10, **extra})


def _run(data_dir: str, run_dir, resume: str | None = None, signals: dict | None = None, **extra) -> dict:
    SIGNALS_AT_CALLS.clear()
    SIGNALS_AT_CALLS.update(signals or {})
    PROBE_CALLS.clear()
    try:
        return train(load_config(None, _overrides(data_dir, **extra)), str(run_dir), resume=resume)
    finally:
        SIGNALS_AT_CALLS.clear()


@pytest.fixture(autouse=True)
def _no_nan():
    NAN_AT_CALLS.clear()


@pytest.fixture(scope='module')
def uninterrupted(data_dir, tmp_path_factory) -> str:
    """The run every stopped and continued run below must reproduce."""
    run_dir = tmp_path_factory.mktemp('uninterrupted')
    NAN_AT_CALLS.clear()
    _run(data_dir, run_dir, **{'checkpoint.every_n_steps': 2})
    return str(run_dir)


def _names(run_dir) -> list[str]:
    return [os.path.basename(folder) for _, folder in list_checkpoints(str(run_dir))]


def _metrics(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, 'metrics.jsonl')) as f:
        return [json.loads(line) for line in f]


def _count_saves(monkeypatch) -> list[str]:
    saved = []
    save = trainer.save_checkpoint
    monkeypatch.setattr(trainer, 'save_checkpoint', lambda run_dir, name, *args: (saved.append(name),
                                                                                  save(run_dir, name, *args))[1])
    return saved


def _signal_while_writing(monkeypatch, suffix: str, *signums: signal.Signals) -> None:
    """Send ``signums`` to this process while the checkpoint file ending in ``suffix`` is being written."""
    write = train_state.save_torch

    def write_and_signal(obj, path):
        if path.endswith(suffix):
            for signum in signums:
                os.kill(os.getpid(), signum)
        write(obj, path)
    monkeypatch.setattr(train_state, 'save_torch', write_and_signal)


def test_sigterm_on_a_periodic_step_saves_that_step_once(data_dir, tmp_path, monkeypatch, uninterrupted):
    saved = _count_saves(monkeypatch)
    summary = _run(data_dir, tmp_path / 'run', signals={('train', 4): signal.SIGTERM},
                   **{'checkpoint.every_n_steps': 2})
    assert summary['status'] == 'stopped' and summary['step'] == 4
    assert saved == ['step_00000002', 'step_00000004']  # not step_00000004 a second time
    _run(data_dir, tmp_path / 'run', resume='auto', **{'checkpoint.every_n_steps': 2})
    assert_same_run(str(tmp_path / 'run'), uninterrupted, 'epoch_0002')


def test_the_stop_line_names_the_checkpoint_saved_or_says_none_was(data_dir, tmp_path, monkeypatch, caplog):
    class StoppedAtOnce(trainer.StopSignal):
        def __enter__(self) -> 'StoppedAtOnce':
            super().__enter__()
            os.kill(os.getpid(), signal.SIGTERM)  # before the first update: nothing to save
            return self

    def stop_line() -> str:
        (line,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith('stopped by SIGTERM')]
        caplog.clear()
        return line
    with caplog.at_level(logging.INFO, logger='lipsformer'):
        with monkeypatch.context() as patch:
            patch.setattr(trainer, 'StopSignal', StoppedAtOnce)
            summary = _run(data_dir, tmp_path / 'run')
        assert summary['status'] == 'stopped' and summary['step'] == 0 and _names(tmp_path / 'run') == []
        assert 'before epoch 1; no checkpoint was saved, since nothing has trained yet' in stop_line()
        summary = _run(data_dir, tmp_path / 'run', resume='auto', signals={('train', 3): signal.SIGTERM})
        assert summary['status'] == 'stopped' and _names(tmp_path / 'run') == ['step_00000003']
        checkpoint = os.path.join(tmp_path / 'run', 'checkpoints', 'step_00000003')
        assert f'at step 3; the checkpoint is {checkpoint}, continue with --resume auto' in stop_line()


def test_sigterm_during_a_save_finishes_it_and_stops_without_another_update(data_dir, tmp_path, monkeypatch, caplog,
                                                                           uninterrupted):
    """The second SIGTERM (a cluster that repeats itself) changes nothing either."""
    _signal_while_writing(monkeypatch, os.path.join('.tmp-step_00000002', 'optimizer.pt'), signal.SIGTERM,
                          signal.SIGTERM)
    saved = _count_saves(monkeypatch)
    summary = _run(data_dir, tmp_path / 'run', **{'checkpoint.every_n_steps': 2})
    assert summary['status'] == 'stopped' and summary['step'] == 2 and saved == ['step_00000002']
    assert 'received SIGTERM again: already stopping after saving a checkpoint' in caplog.text
    monkeypatch.undo()
    _run(data_dir, tmp_path / 'run', resume='auto', **{'checkpoint.every_n_steps': 2})
    assert_same_run(str(tmp_path / 'run'), uninterrupted, 'epoch_0002')


def test_sigterm_during_evaluation_cuts_it_short_and_the_continued_run_scores_that_epoch_first(data_dir, tmp_path,
                                                                                               uninterrupted):
    """The epoch's checkpoint is saved before the evaluation, which stops at the next batch: a scheduler's grace
    period does not have to cover two ImageNet evaluations."""
    summary = _run(data_dir, tmp_path / 'run', signals={('eval', 1): signal.SIGTERM},
                   **{'checkpoint.every_n_steps': 2})
    assert summary['status'] == 'stopped' and summary['epochs_done'] == 1
    assert PROBE_CALLS['eval'] == 1  # of the 4 batches of the raw and the EMA evaluation
    assert _names(tmp_path / 'run')[-1] == 'epoch_0001'
    assert read_meta(str(tmp_path / 'run' / 'checkpoints' / 'epoch_0001'))['progress']['unscored']['epoch'] == 1
    assert _metrics(tmp_path / 'run') == []
    _run(data_dir, tmp_path / 'run', resume='auto', **{'checkpoint.every_n_steps': 2})
    assert_same_run(str(tmp_path / 'run'), uninterrupted, 'epoch_0002')
    best = json.load(open(tmp_path / 'run' / 'checkpoints' / 'best.json'))
    assert best == json.load(open(os.path.join(uninterrupted, 'checkpoints', 'best.json')))


def _train_py():
    """train.py's main(), imported from the file as a module."""
    spec = importlib.util.spec_from_file_location('train_cli', os.path.join(REPO, 'train.py'))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


def _cli(data_dir: str, run_dir, *extra: str, signals: dict | None = None, **overrides) -> int:
    SIGNALS_AT_CALLS.clear()
    SIGNALS_AT_CALLS.update(signals or {})
    try:
        return _train_py()(['--output', str(run_dir), *extra, *_overrides(data_dir, **overrides)])
    finally:
        SIGNALS_AT_CALLS.clear()


def test_sigint_stops_cleanly_and_a_second_one_aborts_without_saving(data_dir, tmp_path, monkeypatch, caplog,
                                                                     uninterrupted):
    run_dir = tmp_path / 'run'
    assert _cli(data_dir, run_dir, signals={('train', 3): signal.SIGINT}, **{'checkpoint.every_n_steps': 2}) == 0
    assert _names(run_dir) == ['step_00000002', 'step_00000003']
    _signal_while_writing(monkeypatch, os.path.join('.tmp-step_00000004', 'optimizer.pt'), signal.SIGINT)
    with caplog.at_level(logging.ERROR):
        code = _cli(data_dir, run_dir, '--resume', 'auto', signals={('train', 1): signal.SIGINT},
                    **{'checkpoint.every_n_steps': 2})
    assert code == 130 and 'aborted by a second Ctrl-C without saving' in caplog.text
    assert _names(run_dir) == ['step_00000002', 'step_00000003']  # the save it aborted never became a checkpoint
    assert os.path.isdir(run_dir / 'checkpoints' / '.tmp-step_00000004')
    monkeypatch.undo()
    assert _cli(data_dir, run_dir, '--resume', 'auto', **{'checkpoint.every_n_steps': 2}) == 0
    assert not [name for name in os.listdir(run_dir / 'checkpoints') if name.startswith('.')]
    assert_same_run(str(run_dir), uninterrupted, 'epoch_0002')


def test_every_way_a_run_ends_has_its_own_exit_status_and_reason(data_dir, tmp_path, monkeypatch, caplog):
    assert _cli(data_dir, tmp_path / 'config', **{'optimizer.lr': 0}) == 2
    assert _cli(data_dir, tmp_path / 'data', **{'data.val_split': 'vaildation'}) == 2
    assert "no split 'vaildation'" in caplog.text
    NAN_AT_CALLS.update(range(1, 100))
    assert _cli(data_dir, tmp_path / 'diverged', **{'train.max_nonfinite_steps': 2}) == 3
    assert 'training diverged: the loss was not finite for 2 consecutive updates' in caplog.text
    NAN_AT_CALLS.clear()

    def disk_full(obj, path):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), path)
    with monkeypatch.context() as patch:
        patch.setattr(train_state, 'save_torch', disk_full)
        assert _cli(data_dir, tmp_path / 'full') == 4
    assert 'the operating system refused a read or write: [Errno 28] No space left on device' in caplog.text

    def bug(model):
        raise TypeError('a bug')
    with monkeypatch.context() as patch:
        patch.setattr(trainer, 'alpha_statistics', bug)
        assert _cli(data_dir, tmp_path / 'bug') == 1
    assert 'unexpected error (please report it with the traceback above): TypeError: a bug (exit 1)' in caplog.text


def test_a_sigterm_after_the_loop_waits_until_the_reason_is_said(data_dir, tmp_path, monkeypatch, caplog):
    """torchrun sends SIGTERM to every other process as soon as one fails: one that arrives while a run ends on its
    own error (here as the accelerator is released) is held until train.py has said why, and the exit status stays the
    reason's. A handler of the test's own stands for the default action, which would end pytest."""
    terminations = []
    release = trainer.release_accelerator

    def terminated_while_releasing():
        os.kill(os.getpid(), signal.SIGTERM)
        release()
    monkeypatch.setattr(trainer, 'release_accelerator', terminated_while_releasing)
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: terminations.append(signum))
    NAN_AT_CALLS.update(range(1, 100))
    try:
        with caplog.at_level(logging.WARNING):
            code = _cli(data_dir, tmp_path / 'run', **{'train.max_nonfinite_steps': 2})
    finally:
        NAN_AT_CALLS.clear()
        signal.signal(signal.SIGTERM, previous)
    assert code == 3 and terminations == []
    said = [record.getMessage() for record in caplog.records]
    held = said.index('received SIGTERM while the run ends: exiting once the reason is reported')
    assert said[held + 1].startswith('training diverged: the loss was not finite for 2 consecutive updates')


def test_a_sigterm_before_the_loop_goes_to_the_handler_the_caller_had():
    """train.py's main() called from a program with a SIGTERM handler of its own: before a loop has run, that handler
    gets the signal, as it would without train.py's."""
    from lipsformer.training.signals import HeldTermination
    seen = []
    previous = signal.signal(signal.SIGTERM, lambda signum, frame: seen.append(signum))
    try:
        with HeldTermination():
            os.kill(os.getpid(), signal.SIGTERM)
        assert seen == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, previous)


def test_a_sigterm_before_the_loop_ends_the_process_at_once():
    """Before a training loop has run there is nothing to save or report: SIGTERM's default action, as without
    train.py's handler (in a child process, which it ends)."""
    script = ('import os, signal\n'
              'from lipsformer.training.signals import HeldTermination\n'
              'with HeldTermination():\n'
              '    os.kill(os.getpid(), signal.SIGTERM)\n'
              '    print("still here")\n')
    ended = subprocess.run([sys.executable, '-c', script], capture_output=True, text=True, timeout=120,
                           env=subprocess_env())
    assert ended.returncode == -signal.SIGTERM and 'still here' not in ended.stdout, ended.stderr


class _FillingFile(io.FileIO):
    """A file on a disk that fills up after its first kilobyte: the write that would pass it fails with ENOSPC."""

    def write(self, data) -> int:
        if self.tell() + len(data) > 1024:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return super().write(data)


@pytest.mark.parametrize('file', ['optimizer.pt', 'model.safetensors'])
def test_a_full_disk_during_a_save_is_status_4_with_the_system_s_words(data_dir, tmp_path, monkeypatch, caplog,
                                                                        uninterrupted, file):
    """The disk fills while the first epoch's checkpoint is written: torch.save's error is its own ("enforce fail at
    inline_container.cc"), with the OSError in its context; safetensors' names the system's error only in its text.
    Both are exit 4 with "No space left on device" in the last line; the checkpoints saved before are whole and the
    run continues exactly."""
    saving = os.path.join('.tmp-epoch_0001', '')
    if file == 'optimizer.pt':  # torch writes into the file the package opens
        def open_on_a_full_disk(path, mode='r', **kwargs):
            if saving + '.optimizer.pt.' in path:
                return _FillingFile(path, 'wb')
            return open(path, mode, **kwargs)
        monkeypatch.setattr(io_module, 'open', open_on_a_full_disk, raising=False)
    else:  # safetensors opens its own file; this is what it raises when the disk is full (0.5 on)
        save_file = io_module.save_file

        def save_file_on_a_full_disk(tensors, path):
            if saving + '.model.safetensors.' in path:
                raise SafetensorError('Error while serializing: I/O error: No space left on device (os error 28)')
            save_file(tensors, path)
        monkeypatch.setattr(io_module, 'save_file', save_file_on_a_full_disk)
    run_dir = tmp_path / 'run'
    with caplog.at_level(logging.ERROR):
        assert _cli(data_dir, run_dir, **{'checkpoint.every_n_steps': 2}) == 4
    last = caplog.records[-1].getMessage()
    assert last.startswith('the operating system refused a read or write: [Errno 28] No space left on device')
    assert ('(reported as RuntimeError: [enforce fail at inline_container.cc' if file == 'optimizer.pt' else
            os.path.join('.tmp-epoch_0001', 'model.safetensors')) in last and last.endswith('(exit 4)')
    assert 'please report' not in caplog.text
    assert _names(run_dir) == ['step_00000002', 'step_00000004']
    monkeypatch.undo()
    assert _cli(data_dir, run_dir, '--resume', 'auto', **{'checkpoint.every_n_steps': 2}) == 0
    assert_same_run(str(run_dir), uninterrupted, 'epoch_0002')
