"""Resuming a run when something has changed: the config (applied and said, or refused leaving the run folder as it
was), a checkpoint that cannot be read (the one before it is taken), an explicit resume of an older checkpoint (the
newer ones are moved aside), a torn metrics line."""
import json
import logging
import os
import re
import signal
import time

import pytest
import torch
from image_data import make_image_folder
from probe_models import SIGNALS_AT_CALLS
from training_support import tiny_overrides

from lipsformer.training import load_config, train
from lipsformer.training.train_state import Progress, latest_checkpoint, list_checkpoints, read_meta, update_progress
from lipsformer.weights.weight_files import CheckpointError
from lipsformer.weights.weight_files import load_file as load_any

pytestmark = pytest.mark.usefixtures('one_thread', 'probe_model')


def _run(data_dir: str, run_dir, resume: str | None = None, **extra) -> dict:
    overrides = tiny_overrides(data_dir, **{'model.name': 'nan_probe_net', 'model.kwargs': '{}',
                                            'checkpoint.export': False, 'checkpoint.keep_last': 10, **extra})
    return train(load_config(None, overrides), str(run_dir), resume=resume)


@pytest.fixture
def one_epoch(data_dir, tmp_path) -> str:
    run_dir = str(tmp_path / 'run')
    _run(data_dir, run_dir, **{'train.epochs': 1})
    return run_dir


def _folder_state(run_dir: str) -> dict[str, bytes]:
    """Every file of the run folder but its log, with its content."""
    state = {}
    for folder, _, files in os.walk(run_dir):
        for name in files:
            if name != 'train.log':
                path = os.path.join(folder, name)
                state[os.path.relpath(path, run_dir)] = open(path, 'rb').read()
    return state


def test_changed_optimizer_settings_are_the_config_s_and_are_said(data_dir, one_epoch, caplog):
    """Loading the optimizer's state used to bring back the checkpoint's weight decay and betas while config.yaml
    claimed the new ones."""
    _run(data_dir, one_epoch, resume='auto', **{'optimizer.weight_decay': 0.1, 'optimizer.betas': '[0.8, 0.99]'})
    assert ("the optimizer continues with the config's settings, not the checkpoint's: group 0 betas: (0.9, 0.999) "
            "-> (0.8, 0.99); group 1 weight_decay: 0.05 -> 0.1; group 1 betas: (0.9, 0.999) -> (0.8, 0.99)"
            ) in caplog.text  # group 0: biases and other 1-D parameters, not decayed
    groups = load_any(os.path.join(one_epoch, 'checkpoints', 'epoch_0002', 'optimizer.pt'))['param_groups']
    assert [(g['weight_decay'], tuple(g['betas'])) for g in groups] == [(0.0, (0.8, 0.99)), (0.1, (0.8, 0.99))]
    assert load_config(os.path.join(one_epoch, 'config.yaml')).optimizer.weight_decay == 0.1


@pytest.mark.parametrize('change, message', [
    ({'model.num_classes': 5}, "checkpoint model.safetensors does not fit NanProbeNet .shape mismatch: head.bias"),
    ({'optimizer.name': 'sgd'}, "was trained with optimizer.name=adamw, the config says sgd: its state cannot "
                                "continue another optimizer"),
    ({'model.name': 'resnet10t', 'model.img_size': 'null'},
     'was trained with model.name=nan_probe_net, the config says resnet10t'),
    ({'train.batch_size': 4}, 'another batch layout .global_batch_size 8 -> 4'),
])
def test_a_refused_resume_leaves_the_run_folder_as_it_was(data_dir, one_epoch, change, message):
    """config.yaml in particular: it must go on describing the model of the checkpoints next to it."""
    before = _folder_state(one_epoch)
    with pytest.raises(CheckpointError, match=message):
        _run(data_dir, one_epoch, resume='auto', **change)
    assert _folder_state(one_epoch) == before


def test_other_training_classes_are_refused(data_dir, tmp_path, one_epoch):
    renamed = tmp_path / 'renamed'
    os.makedirs(renamed)
    for split in ('train', 'validation'):
        for index in range(4):
            os.makedirs(renamed / split, exist_ok=True)
            os.symlink(os.path.join(data_dir, split, f'class_{index}'), renamed / split / f'kind_{index}')
    with pytest.raises(CheckpointError, match="trained on the classes class_0, class_1, class_2, class_3, the training "
                                              "split now has kind_0, kind_1, kind_2, kind_3"):
        _run(str(renamed), one_epoch, resume='auto')


def test_a_smaller_copy_of_the_data_is_refused_naming_the_data_set_size(data_dir, tmp_path, one_epoch):
    """The refusal spoke of another batch layout and told the user to keep train.batch_size, which they had."""
    smaller = make_image_folder(str(tmp_path / 'smaller'), train_per_class=6)
    before = _folder_state(one_epoch)
    with pytest.raises(CheckpointError, match=r"epoch_0001' was saved at an epoch boundary with 48 training images "
                                              r"\(6 updates an epoch\); the training data now has 24 images "
                                              r"\(3 updates an epoch\) with the same batch layout: data.data_dir "
                                              r"'.*smaller' \(split 'train'\) holds another data set"):
        _run(smaller, one_epoch, resume='auto')
    assert _folder_state(one_epoch) == before


def test_an_unreadable_newest_checkpoint_is_set_aside_and_the_one_before_taken(data_dir, tmp_path, caplog):
    run_dir = tmp_path / 'run'
    _run(data_dir, run_dir)
    newest = run_dir / 'checkpoints' / 'epoch_0002'
    weights = (newest / 'model.safetensors').read_bytes()
    (newest / 'model.safetensors').write_bytes(weights[:len(weights) // 2])  # a copy cut short, a failing disk
    os.makedirs(run_dir / 'checkpoints' / '.tmp-step_00000009')  # left by a process killed while saving
    with pytest.raises(CheckpointError, match=r"cannot resume from '.*epoch_0002': .*corrupt or truncated "
                                              r"safetensors file.*\)\. Resume from an older checkpoint, or with "
                                              r"--resume auto"):
        _run(data_dir, run_dir, resume=str(newest))
    summary = _run(data_dir, run_dir, resume='auto', **{'train.epochs': 3})
    assert summary['status'] == 'finished' and summary['step'] == 18
    assert 'epoch_0002 cannot be read' in caplog.text
    assert 'continues from the newest checkpoint before it that can be read' in caplog.text
    (aside,) = os.listdir(run_dir / 'checkpoints' / 'unreadable')
    assert aside.startswith('epoch_0002-')
    assert (run_dir / 'checkpoints' / 'unreadable' / aside / 'model.safetensors').read_bytes() == weights[:len(
        weights) // 2]  # kept as it was, not deleted
    assert not [name for name in os.listdir(run_dir / 'checkpoints') if name.startswith('.')]
    lines = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
    assert [(line['epoch'], line['step']) for line in lines] == [(1, 6), (2, 12), (3, 18)]


def test_resuming_an_older_checkpoint_moves_the_newer_ones_aside(data_dir, tmp_path, caplog):
    """Otherwise a later --resume auto would pick the abandoned run's epoch_0002 over this branch's step 8."""
    run_dir = tmp_path / 'run'
    _run(data_dir, run_dir)
    SIGNALS_AT_CALLS[('train', 2)] = signal.SIGTERM  # at the second update of the resumed run: step 8
    try:
        summary = _run(data_dir, run_dir, resume=str(run_dir / 'checkpoints' / 'epoch_0001'))
    finally:
        SIGNALS_AT_CALLS.clear()
    assert summary['status'] == 'stopped' and summary['step'] == 8
    assert 'abandons 1 newer checkpoint(s) of this run (epoch_0002)' in caplog.text
    assert os.path.basename(latest_checkpoint(str(run_dir))) == 'step_00000008'
    (aside,) = os.listdir(run_dir / 'checkpoints' / 'abandoned')
    assert aside.startswith('epoch_0002-')
    best = json.load(open(run_dir / 'checkpoints' / 'best.json'))
    assert best['name'] == 'epoch_0001' and best['epoch'] == 1  # not the abandoned epoch_0002
    summary = _run(data_dir, run_dir, resume='auto')
    assert summary['status'] == 'finished' and summary['step'] == 12
    assert [os.path.basename(f) for _, f in list_checkpoints(str(run_dir))] == [
        'epoch_0001', 'step_00000008', 'epoch_0002']


def test_metrics_lines_past_an_older_checkpoint_are_moved_to_orphaned_and_said(data_dir, tmp_path, caplog):
    """The file appeared without a word; the lines of the abandoned epochs must stay, and the user must learn where."""
    run_dir = tmp_path / 'run'
    _run(data_dir, run_dir, **{'train.epochs': 3})
    before = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
    with caplog.at_level(logging.WARNING):
        _run(data_dir, run_dir, resume=str(run_dir / 'checkpoints' / 'epoch_0001'), **{'train.epochs': 3})
    assert ('metrics.jsonl: 2 line(s) past the checkpoint resumed from (epoch 2, 3) are moved to '
            'metrics.jsonl.orphaned') in caplog.text
    assert [json.loads(line) for line in open(run_dir / 'metrics.jsonl.orphaned')] == before[1:]
    after = [json.loads(line) for line in open(run_dir / 'metrics.jsonl')]
    assert after[0] == before[0] and [line['epoch'] for line in after] == [1, 2, 3]


def test_a_torn_metrics_line_is_dropped_and_said(data_dir, one_epoch, caplog):
    with open(os.path.join(one_epoch, 'metrics.jsonl'), 'a') as f:
        f.write('{"epoch": 2, "step": 1')  # a kill or a full disk during an append
    with caplog.at_level(logging.WARNING):
        summary = _run(data_dir, one_epoch, resume='auto', **{'train.epochs': 2})
    assert summary['status'] == 'finished'
    assert 'metrics.jsonl: line 2 is not a whole JSON record' in caplog.text
    lines = [json.loads(line) for line in open(os.path.join(one_epoch, 'metrics.jsonl'))]
    assert [line['epoch'] for line in lines] == [1, 2]
    assert read_meta(os.path.join(one_epoch, 'checkpoints', 'epoch_0002'))['progress']['history'] == lines


def test_a_finished_run_refuses_changed_keys_and_keeps_its_config(data_dir, one_epoch):
    """Nothing would train with them, yet config.yaml (the documented way to repeat the run) would claim them."""
    before = _folder_state(one_epoch)
    with pytest.raises(CheckpointError, match=r"has finished its 1 epoch\(s\): nothing would train with the changed "
                                              r"keys \(optimizer.lr: 0.002 -> 0.005\)"):
        _run(data_dir, one_epoch, resume='auto', **{'train.epochs': 1, 'optimizer.lr': 5e-3})
    assert _folder_state(one_epoch) == before
    summary = _run(data_dir, one_epoch, resume='auto', **{'train.epochs': 1})  # unchanged: as before
    assert summary['status'] == 'finished' and summary['epochs_done'] == 1


def test_changed_keys_are_recorded_with_the_step_they_apply_from(data_dir, one_epoch, caplog):
    steps = read_meta(latest_checkpoint(one_epoch))['progress']['step']
    original = load_config(os.path.join(one_epoch, 'config.yaml'))
    _run(data_dir, one_epoch, resume='auto', **{'train.epochs': 2, 'optimizer.lr': 5e-3})
    assert load_config(os.path.join(one_epoch, 'config.yaml')).optimizer.lr == 5e-3
    earlier = load_config(os.path.join(one_epoch, f'config.before_step_{steps:08d}.yaml'))
    assert earlier == original and earlier.optimizer.lr == 2e-3
    assert (f'resuming with config keys changed since the checkpoint, applied from step {steps}: optimizer.lr: '
            f'0.002 -> 0.005, train.epochs: 1 -> 2; config.yaml holds them, config.before_step_{steps:08d}.yaml '
            f'what the steps before used') in caplog.text


def test_a_resume_into_a_new_folder_keeps_the_config_of_the_steps_before_it_names(data_dir, one_epoch, tmp_path,
                                                                                   caplog):
    """The log named config.before_step_<step>.yaml, which was written only where a config.yaml was replaced."""
    steps = read_meta(latest_checkpoint(one_epoch))['progress']['step']
    new_dir = tmp_path / 'continued'
    _run(data_dir, new_dir, resume=latest_checkpoint(one_epoch), **{'train.epochs': 2, 'optimizer.lr': 5e-3})
    named = re.search(r'config.yaml holds them, (\S+) what the steps before used', caplog.text).group(1)
    assert named == f'config.before_step_{steps:08d}.yaml'
    assert load_config(new_dir / named) == load_config(os.path.join(one_epoch, 'config.yaml'))
    assert load_config(new_dir / 'config.yaml').optimizer.lr == 5e-3


def test_resuming_an_older_checkpoint_under_the_current_config_keeps_the_checkpoint_s(data_dir, tmp_path, caplog):
    """config.yaml already held the new values, so nothing was renamed, yet the log named a file."""
    run_dir = tmp_path / 'run'
    _run(data_dir, run_dir, **{'train.epochs': 1, 'checkpoint.every_n_steps': 3})
    changed = {'train.epochs': 2, 'optimizer.lr': 5e-3, 'checkpoint.every_n_steps': 3}
    _run(data_dir, run_dir, resume='auto', **changed)
    caplog.clear()
    _run(data_dir, run_dir, resume=str(run_dir / 'checkpoints' / 'step_00000003'), **changed)
    named = re.search(r'config.yaml holds them, (\S+) what the steps before used', caplog.text).group(1)
    assert named == 'config.before_step_00000003.yaml'
    assert load_config(run_dir / named).optimizer.lr == 2e-3
    assert load_config(run_dir / 'config.yaml').optimizer.lr == 5e-3


def test_wall_time_counts_every_start(data_dir, tmp_path):
    run_dir = tmp_path / 'run'
    first = _run(data_dir, run_dir, **{'train.epochs': 1})
    checkpoint = latest_checkpoint(str(run_dir))
    progress = Progress(**read_meta(checkpoint)['progress'])
    assert 0 < progress.wall_time_s <= first['wall_time_s']
    progress.wall_time_s = 1000.0  # as if the first start had taken that long to reach its checkpoint
    update_progress(checkpoint, progress)
    start = time.perf_counter()
    second = _run(data_dir, run_dir, resume='auto', **{'train.epochs': 2})
    assert 1000.0 < second['wall_time_s'] <= 1000.0 + time.perf_counter() - start
    assert json.load(open(run_dir / 'summary.json'))['wall_time_s'] == second['wall_time_s']
    assert read_meta(latest_checkpoint(str(run_dir)))['progress']['wall_time_s'] > 1000.0


def test_the_speed_of_a_resumed_epoch_counts_the_time_of_the_images_it_counts():
    """A mid-epoch resume brings back the epoch's images so far; its speed must not divide them by this start's
    seconds alone (the first progress lines after a resume showed many times the real img/s)."""
    from lipsformer.training.loop import EpochTally
    progress = Progress(epoch=0, batch_in_epoch=10, epoch_totals=[5.0, 10.0, 1000, 10.0, 0])
    tally = EpochTally.start(torch.device('cpu'), progress, is_main=True)
    tally.images += 8
    assert tally.images_per_s() == pytest.approx(1008 / (10.0 + time.perf_counter() - tally.start_time), rel=1e-2)
    assert tally.images_per_s() < 101
