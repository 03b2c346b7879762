"""Faults a long run meets: non-finite losses, unreadable images, preemption (SIGTERM) and kill -9, even in the
middle of writing a checkpoint. Nothing already saved may be lost, and the run must be able to continue."""
import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from image_data import make_image_folder
from probe_models import NAN_AT_CALLS
from process_support import subprocess_env
from training_support import assert_same_run, tiny_overrides

from lipsformer.training import NonFiniteLossError, load_config, train
from lipsformer.training.train_command import main
from lipsformer.training.train_state import latest_checkpoint, list_checkpoints, read_meta
from lipsformer.weights.weight_files import load_file

pytestmark = pytest.mark.usefixtures('one_thread', 'probe_model')

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
UPDATES_PER_EPOCH, VAL_IMAGES = 6, 24

def _probe_overrides(data_dir: str, **extra) -> list[str]:
    return tiny_overrides(data_dir, **{'model.name': 'nan_probe_net', 'model.kwargs': '{}',
                                       'checkpoint.export': False, **extra})


def test_isolated_nonfinite_losses_are_skipped_and_counted(data_dir, tmp_path, caplog):
    NAN_AT_CALLS.clear()
    NAN_AT_CALLS.update({3, 9})
    summary = train(load_config(None, _probe_overrides(data_dir)), str(tmp_path / 'run'))
    assert summary['status'] == 'finished' and summary['nonfinite_steps'] == 2
    lines = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
    assert [line['nonfinite_steps'] for line in lines] == [1, 2]
    assert all(torch.isfinite(v).all() for v in load_file(os.path.join(summary['last_checkpoint'],
                                                                       'model.safetensors')).values())
    assert 'non-finite loss at step 3 (epoch 1): update skipped (1 in a row, 1 in all)' in caplog.text


def test_persistent_nonfinite_loss_stops_and_names_the_last_good_checkpoint(data_dir, tmp_path):
    NAN_AT_CALLS.clear()
    NAN_AT_CALLS.update(range(UPDATES_PER_EPOCH + 2, 100))
    run_dir = tmp_path / 'run'
    good = os.path.join(run_dir, 'checkpoints', 'epoch_0001')
    with pytest.raises(NonFiniteLossError, match=f'3 consecutive updates, the last at step 10 .epoch 2.; stopping. '
                                                 f'The last good checkpoint is {good}'):
        train(load_config(None, _probe_overrides(data_dir, **{'train.max_nonfinite_steps': 3})), str(run_dir))
    assert [os.path.basename(folder) for _, folder in list_checkpoints(str(run_dir))] == ['epoch_0001']
    assert read_meta(good)['progress']['step'] == UPDATES_PER_EPOCH
    assert all(torch.isfinite(v).all() for v in load_file(os.path.join(good, 'model.safetensors')).values())
    NAN_AT_CALLS.clear()
    summary = train(load_config(None, _probe_overrides(data_dir)), str(run_dir), resume='auto')
    assert summary['status'] == 'finished' and summary['step'] == 2 * UPDATES_PER_EPOCH


def _all_finite(folder: str) -> bool:
    """Whether every tensor of every safetensors file in ``folder`` is finite."""
    return all(torch.isfinite(tensor).all() for name in os.listdir(folder) if name.endswith('.safetensors')
               for tensor in load_file(os.path.join(folder, name)).values())


def test_non_finite_updates_in_a_row_are_counted_across_epochs(data_dir, tmp_path):
    """The count restarted each epoch, so epochs shorter than train.max_nonfinite_steps hid any divergence."""
    NAN_AT_CALLS.clear()
    NAN_AT_CALLS.update(range(UPDATES_PER_EPOCH - 1, 100))  # the last 2 updates of epoch 1 and every one after
    run_dir = tmp_path / 'run'
    with pytest.raises(NonFiniteLossError, match='4 consecutive updates, the last at step 8 .epoch 2.'):
        train(load_config(None, _probe_overrides(data_dir, **{'train.max_nonfinite_steps': 4, 'train.epochs': 3,
                                                               'checkpoint.export': True})), str(run_dir))
    NAN_AT_CALLS.clear()
    summary = json.load(open(run_dir / 'summary.json'))
    assert summary['status'] == 'diverged' and summary['step'] == 7 and 'exports' not in summary
    assert not os.path.exists(run_dir / 'export')
    assert read_meta(latest_checkpoint(str(run_dir)))['progress']['nonfinite_in_a_row'] == 2  # saved at epoch 1's end


def test_an_epoch_without_a_finite_loss_reports_nan_not_zero(data_dir, tmp_path):
    NAN_AT_CALLS.clear()
    NAN_AT_CALLS.update(range(UPDATES_PER_EPOCH + 1, 2 * UPDATES_PER_EPOCH + 1))  # every update of epoch 2
    summary = train(load_config(None, _probe_overrides(data_dir)), str(tmp_path / 'run'))
    NAN_AT_CALLS.clear()
    lines = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
    assert lines[0]['train_loss'] > 0 and math.isnan(lines[1]['train_loss'])
    assert summary['status'] == 'finished' and summary['nonfinite_steps'] == UPDATES_PER_EPOCH  # its weights untouched


@pytest.mark.parametrize('at_update, message', [
    (3, 'the weights are not finite after step 3: the run diverged, and they are not saved. No checkpoint before it '
        'is good'),
    (UPDATES_PER_EPOCH + 3, r'the weights are not finite after step 9: .* The last good checkpoint is .*epoch_0001'),
])
def test_weights_that_turn_non_finite_are_never_saved(data_dir, tmp_path, at_update, message):
    """An update with a finite loss can leave the weights infinite; they were saved, scored and exported."""
    run_dir = tmp_path / 'run'
    NAN_AT_CALLS.clear()
    with pytest.raises(NonFiniteLossError, match=message):
        train(load_config(None, _probe_overrides(data_dir, **{
            'checkpoint.every_n_steps': 3, 'checkpoint.export': True, 'lipschitz.enabled': True,
            'lipschitz.target': 'probe_models:PoisonWeights', 'lipschitz.kwargs': f'{{at_update: {at_update}}}'})),
            str(run_dir), trusted_callables=('probe_models:PoisonWeights',))
    assert all(_all_finite(folder) for _, folder in list_checkpoints(str(run_dir)))
    assert len(list_checkpoints(str(run_dir))) == (0 if at_update == 3 else 2)  # step 3 and epoch 1's
    assert not os.path.exists(run_dir / 'export')
    assert json.load(open(run_dir / 'summary.json'))['status'] == 'diverged'


def test_a_diverged_run_exits_3_is_not_called_finished_and_exports_nothing_non_finite(data_dir, tmp_path, caplog):
    """A tiny LipsFormer at lr 1e6: the weights stay finite, the losses do not; it ended with exit 0, status
    finished, train_loss 0.0, val_loss nan and its weights exported."""
    run_dir = tmp_path / 'run'
    overrides = tiny_overrides(data_dir, **{'train.epochs': 1})
    assert main([*overrides, '--output', str(run_dir)]) == 0
    exported = {name: (run_dir / 'export' / 'last' / name).read_bytes() for name in os.listdir(run_dir / 'export' /
                                                                                                'last')}
    extended = tiny_overrides(data_dir, **{'train.epochs': 4, 'optimizer.lr': 1e6})
    assert main([*extended, '--output', str(run_dir), '--resume', 'auto']) == 3
    assert re.match(r'training diverged: the evaluation of epoch 2 gave val_loss nan, ema_val_loss nan: .* The last '
                    r'good checkpoint is .*epoch_0001\. .*\(exit 3\)$', caplog.records[-1].getMessage())
    summary = json.load(open(run_dir / 'summary.json'))
    assert summary['status'] == 'diverged' and summary['final_metrics']['epoch'] == 1  # epoch 2 is never scored
    assert {name: (run_dir / 'export' / 'last' / name).read_bytes() for name in exported} == exported
    for _, folder in list_checkpoints(str(run_dir)):
        assert _all_finite(folder), folder
    lines = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
    assert all(math.isfinite(line['train_loss']) and line['train_loss'] > 0 for line in lines)


@pytest.mark.parametrize('workers', [0, 1])
def test_unreadable_images_are_logged_skipped_and_counted(tmp_path, caplog, workers):
    """Each skip is logged with its file and why it cannot be read, in train.log too (by the process that reads it),
    and counted per epoch in metrics.jsonl (training and evaluation) and over the run in summary.json, loader workers'
    skips included."""
    data_dir = make_image_folder(str(tmp_path / 'images'))
    for name in ('broken.png', 'broken_too.png'):
        (tmp_path / 'images' / 'train' / 'class_0' / name).write_bytes(os.urandom(300))
    good_png = (tmp_path / 'images' / 'validation' / 'class_1').iterdir().__next__().read_bytes()
    (tmp_path / 'images' / 'validation' / 'class_1' / 'truncated.png').write_bytes(good_png[:60])
    summary = train(load_config(None, tiny_overrides(data_dir, **{
        'train.epochs': 2, 'train.batch_size': 10, 'data.num_workers': workers, 'checkpoint.export': False})),
        str(tmp_path / 'run'))
    assert summary['status'] == 'finished'
    assert summary['final_metrics']['val_samples'] == VAL_IMAGES  # the truncated file is left out, not duplicated
    if not workers:  # a worker logs to its own stderr
        assert 'broken.png' in caplog.text and 'truncated.png' in caplog.text
        assert 'skipping unreadable image' in caplog.text
    log = (tmp_path / 'run' / 'train.log').read_text()
    assert re.search(r"skipping unreadable image '.*broken.png' \(index \d+\): cannot identify image file", log)
    assert re.search(r"skipping unreadable image '.*truncated.png' \(index \d+\): .*truncated", log)
    lines = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
    # 50 training images in 5 batches of 10: every image is asked for once an epoch, each broken one skipped
    assert [(line['skipped_images'], line['val_skipped_images']) for line in lines] == [(2, 1), (2, 1)]
    assert (summary['skipped_images'], summary['val_skipped_images']) == (4, 2)
    assert json.load(open(tmp_path / 'run' / 'summary.json'))['skipped_images'] == 4


def _start(args: list[str], **env: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, *args], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, env=subprocess_env(**env), start_new_session=True)


def _wait_for(process: subprocess.Popen, text: str, timeout: float = 120) -> list[str]:
    seen, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        line = process.stdout.readline()
        if not line:
            break
        seen.append(line)
        if text in line:
            return seen
    process.kill()
    raise AssertionError(f'{text!r} never appeared:\n' + ''.join(seen))


def test_sigterm_saves_a_checkpoint_exits_zero_and_the_run_continues(data_dir, tmp_path):
    run_dir = str(tmp_path / 'run')
    args = ['train.py', '--output', run_dir, *tiny_overrides(data_dir, **{
        'train.epochs': 4, 'train.log_interval': 1, 'checkpoint.export': False, 'data.num_workers': 1})]
    process = _start(args)
    _wait_for(process, 'epoch 2 step 8')
    os.killpg(process.pid, signal.SIGTERM)  # as a cluster does: every process of the job, loader workers too
    output = process.communicate(timeout=120)[0]
    assert process.returncode == 0, output
    assert 'received SIGTERM' in output
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['status'] == 'stopped'
    stopped_at = read_meta(latest_checkpoint(run_dir))['progress']
    assert stopped_at['step'] == summary['step'] >= 8 and stopped_at['epoch'] >= 1
    resumed = subprocess.run([sys.executable, *args, '--resume', 'auto'], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env=subprocess_env())
    assert resumed.returncode == 0, resumed.stderr
    lines = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    assert [line['epoch'] for line in lines] == [1, 2, 3, 4]
    assert lines[-1]['step'] == 4 * UPDATES_PER_EPOCH


# Runs train() with the optimizer file of the epoch-2 checkpoint never finishing, as if the machine died mid-save.
_HANG_IN_SAVE = '''
import os, sys, time
import lipsformer.training.train_state as train_state
from lipsformer.training import load_config, train
write = train_state.save_torch
def hanging_write(obj, path):
    if path.endswith(os.path.join('.tmp-epoch_0002', 'optimizer.pt')):
        with open(path, 'wb') as f:
            f.write(b'partial')
        print('HANGING IN SAVE', flush=True)
        time.sleep(600)
    write(obj, path)
train_state.save_torch = hanging_write
train(load_config(None, sys.argv[2:]), sys.argv[1])
'''


def test_kill_during_a_save_leaves_the_previous_checkpoint_loadable(data_dir, tmp_path):
    run_dir = str(tmp_path / 'run')
    overrides = tiny_overrides(data_dir, **{'train.epochs': 3, 'checkpoint.export': False})
    process = _start(['-c', _HANG_IN_SAVE, run_dir, *overrides])
    _wait_for(process, 'HANGING IN SAVE')
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    partial = os.path.join(run_dir, 'checkpoints', '.tmp-epoch_0002')
    assert os.path.isdir(partial) and not os.path.exists(os.path.join(partial, 'meta.json'))
    assert latest_checkpoint(run_dir).endswith('epoch_0001')
    summary = train(load_config(None, overrides), run_dir, resume='auto')
    assert summary['status'] == 'finished' and summary['step'] == 3 * UPDATES_PER_EPOCH
    assert not [name for name in os.listdir(os.path.join(run_dir, 'checkpoints')) if name.startswith('.')]


def test_kill_at_a_random_moment_then_resume_auto_reproduces_the_uninterrupted_run(data_dir, tmp_path):
    """A kill -9 anywhere (an update, a save, an evaluation, between a save and its scores): the continued run ends
    with the weights and metrics of the run that was never interrupted (augmentation and drop path included)."""
    run_dir = str(tmp_path / 'run')
    overrides = tiny_overrides(data_dir, **{'train.epochs': 3, 'train.log_interval': 1, 'checkpoint.every_n_steps': 1,
                                            'checkpoint.export': False})
    args = ['train.py', '--output', run_dir, *overrides]
    process = _start(args)
    update = random.randint(3, 3 * UPDATES_PER_EPOCH - 4)  # then a moment within about one update
    delay = random.uniform(0.0, 0.2)
    print(f'kill -9 {delay:.3f} s after update {update} was logged')  # shown if the test fails, to reproduce it
    _wait_for(process, f'epoch {(update - 1) // UPDATES_PER_EPOCH + 1} step {update}:')
    time.sleep(delay)
    process.send_signal(signal.SIGKILL)
    process.wait(timeout=60)
    stopped_at = read_meta(latest_checkpoint(run_dir))['progress']
    assert stopped_at['step'] < 3 * UPDATES_PER_EPOCH or stopped_at['unscored'], 'the kill came after the run'
    resumed = subprocess.run([sys.executable, *args, '--resume', 'auto'], cwd=REPO, capture_output=True, text=True,
                             timeout=300, env=subprocess_env())
    assert resumed.returncode == 0, resumed.stderr
    train(load_config(None, overrides), str(tmp_path / 'uninterrupted'))
    assert_same_run(run_dir, str(tmp_path / 'uninterrupted'), 'epoch_0003')
