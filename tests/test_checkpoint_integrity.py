"""A checkpoint is never lost and never silently replaced: a damaged ``meta.json`` or weights file whose bytes are not
the ones saved (their SHA-256 is recorded) is set aside as unreadable and named, by ``--resume auto`` through the train
command and by validate.py; the preprocessing of a checkpoint's weights is the one they were trained with, for a
resume, an export, validate.py and hub.convert; and the messages around them name the real cause and next command."""
import errno
import json
import logging
import os
import shutil

import pytest
import yaml
from training_support import tiny_overrides

from lipsformer.evaluation import validate_command
from lipsformer.evaluation.checkpoints import resolve_checkpoint
from lipsformer.hub import convert
from lipsformer.training import load_config, train_command
from lipsformer.training.finish import dataset_tag
from lipsformer.training.train_command import main
from lipsformer.training.train_state import list_checkpoints, read_meta

pytestmark = pytest.mark.usefixtures('one_thread')


def _overrides(data_dir: str, **extra) -> list[str]:
    return tiny_overrides(data_dir, **{'checkpoint.export': False, **extra})


@pytest.fixture(scope='module')
def finished_run(data_dir, tmp_path_factory) -> str:
    """Two epochs with a step checkpoint between them: step_00000008 and epoch_0002 (exported), and epoch_0001 where
    it scored best (the default keep_last of 2 prunes it otherwise)."""
    run_dir = str(tmp_path_factory.mktemp('finished') / 'run')
    argv = [*_overrides(data_dir, **{'checkpoint.every_n_steps': 4, 'checkpoint.export': True}), '--output', run_dir]
    assert main(argv) == 0
    return run_dir


def _copy(run_dir: str, tmp_path) -> str:
    copy = str(tmp_path / 'copy')
    shutil.copytree(run_dir, copy, symlinks=True)
    return copy


def _names(run_dir: str) -> list[str]:
    return [os.path.basename(folder) for _, folder in list_checkpoints(run_dir)]


def _damage_meta(folder: str, how: str) -> None:
    path = os.path.join(folder, 'meta.json')
    if how == 'deleted':
        os.remove(path)
    else:
        text = open(path).read()
        with open(path, 'w') as f:
            f.write(text[:len(text) // 2])


def _flip_bytes(path: str) -> None:
    """Flip the last bytes of a safetensors file: tensor data (the header is at the start), read without complaint."""
    data = bytearray(open(path, 'rb').read())
    for index in range(len(data) - 8, len(data)):
        data[index] ^= 0x40
    with open(path, 'wb') as f:
        f.write(bytes(data))


@pytest.mark.parametrize('how', ['deleted', 'cut'])
def test_a_checkpoint_whose_meta_json_is_damaged_is_set_aside_and_never_pruned(data_dir, finished_run, tmp_path,
                                                                               caplog, how):
    """It was skipped without a word: the run resumed from the older step_00000008 and saved a new epoch_0002 over
    the damaged one (intact weights, EMA and optimizer)."""
    run_dir = _copy(finished_run, tmp_path)
    newest = os.path.join(run_dir, 'checkpoints', 'epoch_0002')
    weights = open(os.path.join(newest, 'model.safetensors'), 'rb').read()
    _damage_meta(newest, how)
    argv = [*_overrides(data_dir, **{'checkpoint.every_n_steps': 4, 'checkpoint.keep_last': 1, 'train.epochs': 3}),
            '--output', run_dir, '--resume', 'auto']
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert f'{newest} cannot be read (' in caplog.text and 'moved to checkpoints/unreadable/' in caplog.text
    assert 'resumed from ' + os.path.join(run_dir, 'checkpoints', 'step_00000008') in caplog.text
    (aside,) = os.listdir(os.path.join(run_dir, 'checkpoints', 'unreadable'))
    assert aside.startswith('epoch_0002-')
    kept = os.path.join(run_dir, 'checkpoints', 'unreadable', aside)
    assert open(os.path.join(kept, 'model.safetensors'), 'rb').read() == weights
    assert {'ema.safetensors', 'optimizer.pt'} <= set(os.listdir(kept))


def test_a_run_whose_only_checkpoint_has_no_meta_json_is_not_started_afresh_over_it(data_dir, tmp_path, caplog):
    """"no checkpoint yet, starting fresh" deleted the checkpoint and replaced export/."""
    run_dir = str(tmp_path / 'run')
    argv = [*_overrides(data_dir, **{'train.epochs': 1, 'checkpoint.export': True}), '--output', run_dir]
    assert main(argv) == 0
    only = os.path.join(run_dir, 'checkpoints', 'epoch_0001')
    weights = open(os.path.join(only, 'model.safetensors'), 'rb').read()
    export = open(os.path.join(run_dir, 'export', 'last', 'model.safetensors'), 'rb').read()
    os.remove(os.path.join(only, 'meta.json'))
    assert main(argv) == 2  # a new run over it
    assert 'already holds checkpoints of a run' in caplog.records[-1].getMessage()
    caplog.clear()
    assert main([*argv, '--resume', 'auto']) == 2
    assert 'starting fresh' not in caplog.text
    assert 'epoch_0001 cannot be read (its meta.json is missing)' in caplog.text
    assert 'no checkpoint of' in caplog.records[-1].getMessage()
    (aside,) = os.listdir(os.path.join(run_dir, 'checkpoints', 'unreadable'))
    assert open(os.path.join(run_dir, 'checkpoints', 'unreadable', aside, 'model.safetensors'), 'rb').read() == weights
    assert open(os.path.join(run_dir, 'export', 'last', 'model.safetensors'), 'rb').read() == export


def test_an_explicit_resume_of_an_older_checkpoint_sets_a_damaged_one_aside_before_saving(data_dir, finished_run,
                                                                                          tmp_path, caplog):
    """The resumed run saves its own epoch_0002, which replaced the damaged folder of that name."""
    run_dir = _copy(finished_run, tmp_path)
    newest = os.path.join(run_dir, 'checkpoints', 'epoch_0002')
    weights = open(os.path.join(newest, 'model.safetensors'), 'rb').read()
    _damage_meta(newest, 'deleted')
    argv = [*_overrides(data_dir, **{'checkpoint.every_n_steps': 4}), '--output', run_dir,
            '--resume', os.path.join(run_dir, 'checkpoints', 'step_00000008')]
    assert main(argv) == 0
    assert f'{newest} cannot be read (its meta.json is missing); it is moved to ' in caplog.text
    (aside,) = os.listdir(os.path.join(run_dir, 'checkpoints', 'unreadable'))
    assert open(os.path.join(run_dir, 'checkpoints', 'unreadable', aside, 'model.safetensors'), 'rb').read() == weights
    assert 'epoch_0002' in _names(run_dir)  # saved anew beside it


def test_validate_does_not_score_an_older_checkpoint_in_place_of_a_damaged_one(data_dir, finished_run, tmp_path,
                                                                               capsys):
    run_dir = _copy(finished_run, tmp_path)
    import shutil
    shutil.rmtree(os.path.join(run_dir, 'export'))
    _damage_meta(os.path.join(run_dir, 'checkpoints', 'epoch_0002'), 'cut')
    assert validate_command.main(['--checkpoint', run_dir, '--data-layout', 'imagefolder',
                                  '--data-dir', os.path.join(data_dir, 'validation'), '--workers', '0']) == 2
    error = capsys.readouterr().err
    assert 'which of its checkpoints is the newest is unknown (epoch_0002: cannot read' in error
    assert '--resume auto' in error


def test_weights_whose_bytes_changed_are_set_aside_on_resume_and_refused_by_validate(data_dir, finished_run,
                                                                                     tmp_path, caplog, capsys):
    """Flipped bytes loaded without complaint; the run then diverged naming the corrupted checkpoint as good."""
    run_dir = _copy(finished_run, tmp_path)
    newest = os.path.join(run_dir, 'checkpoints', 'epoch_0002')
    assert set(read_meta(newest)['sha256']) == {'model.safetensors', 'ema.safetensors', 'optimizer.pt',
                                                'trainer_state.pt', 'rng_state_0.pt'}
    _flip_bytes(os.path.join(newest, 'model.safetensors'))
    assert validate_command.main(['--checkpoint', newest, '--data-layout', 'imagefolder',
                                  '--data-dir', os.path.join(data_dir, 'validation'), '--workers', '0']) == 2
    error = capsys.readouterr().err
    assert "model.safetensors' is not the file that was saved: its SHA-256 differs from the one meta.json" in error
    assert 'cannot be built' not in error
    argv = [*_overrides(data_dir, **{'checkpoint.every_n_steps': 4, 'train.epochs': 3}), '--output', run_dir,
            '--resume', 'auto']
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert f'{newest} cannot be read (' in caplog.text and 'is not the file that was saved' in caplog.text
    assert 'resumed from ' + os.path.join(run_dir, 'checkpoints', 'step_00000008') in caplog.text
    assert os.listdir(os.path.join(run_dir, 'checkpoints', 'unreadable'))[0].startswith('epoch_0002-')


def test_an_rng_state_that_is_not_the_one_saved_is_set_aside_on_resume(data_dir, finished_run, tmp_path, caplog):
    """Another checkpoint's RNG state loads without complaint: the resumed run would draw other augmentations and
    drop other paths than the run that saved it, under that checkpoint's name."""
    run_dir = _copy(finished_run, tmp_path)
    newest = os.path.join(run_dir, 'checkpoints', 'epoch_0002')
    older = os.path.join(run_dir, 'checkpoints', 'step_00000008')
    assert open(os.path.join(older, 'rng_state_0.pt'), 'rb').read() != open(os.path.join(newest, 'rng_state_0.pt'),
                                                                             'rb').read()
    shutil.copyfile(os.path.join(older, 'rng_state_0.pt'), os.path.join(newest, 'rng_state_0.pt'))
    argv = [*_overrides(data_dir, **{'checkpoint.every_n_steps': 4, 'train.epochs': 3}), '--output', run_dir,
            '--resume', 'auto']
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert f'{newest} cannot be read (' in caplog.text
    assert "rng_state_0.pt' is not the file that was saved" in caplog.text
    assert 'resumed from ' + older in caplog.text


def test_a_resume_that_changes_the_preprocessing_is_refused_naming_the_keys(data_dir, finished_run, tmp_path, caplog):
    run_dir = _copy(finished_run, tmp_path)
    before = sorted(os.listdir(run_dir))
    argv = [*_overrides(data_dir, **{'checkpoint.every_n_steps': 4, 'train.epochs': 3, 'data.mean': '[0.25]'}),
            '--output', run_dir, '--resume', 'auto']
    assert main(argv) == 2
    message = caplog.records[-1].getMessage()
    assert 'was trained with other preprocessing (data.mean: [0.5] -> [0.25])' in message
    assert 'model.init_checkpoint=' in message and '--output NEW_RUN' in message
    assert sorted(os.listdir(run_dir)) == before
    assert read_meta(os.path.join(run_dir, 'checkpoints', 'epoch_0002'))['data_config']['mean'] == [0.5]


def test_a_checkpoint_is_scored_and_converted_with_its_own_preprocessing_not_an_edited_config(finished_run,
                                                                                               tmp_path):
    """A hand-edited config.yaml changed the mean validate.py and hub.convert used for the checkpoint's weights."""
    run_dir = _copy(finished_run, tmp_path)
    path = os.path.join(run_dir, 'config.yaml')
    config = yaml.safe_load(open(path))
    config['data']['mean'], config['data']['std'] = [0.25], [0.75]
    with open(path, 'w') as f:
        yaml.safe_dump(config, f)
    checkpoint = os.path.join(run_dir, 'checkpoints', 'epoch_0002')  # the last: kept whichever epoch scored best
    overlay = resolve_checkpoint(checkpoint).model_config.cfg_overlay
    assert (overlay['mean'], overlay['std'], overlay['input_size']) == ((0.5,), (0.5,), (1, 32, 32))
    out = str(tmp_path / 'converted')
    assert convert.main([checkpoint, out]) == 0
    written = json.load(open(os.path.join(out, 'config.json')))['pretrained_cfg']
    assert (written['mean'], written['std']) == ([0.5], [0.5])


def test_an_export_says_the_data_set_it_was_trained_on(data_dir, finished_run):
    tag = json.load(open(os.path.join(finished_run, 'export', 'best', 'config.json')))['pretrained_cfg'].get('tag')
    assert tag == os.path.basename(data_dir)  # the image folder's name; it said in1k
    config = load_config(None, ['data.dataset=torch/fashion_mnist', 'data.data_dir=/data'])
    assert dataset_tag(config) == 'fashion_mnist'


def test_file_problems_are_not_called_arguments_the_model_cannot_be_built_with(data_dir, finished_run, tmp_path,
                                                                               capsys):
    run_dir = _copy(finished_run, tmp_path)
    export = os.path.join(run_dir, 'export', 'best')
    weights = open(os.path.join(export, 'model.safetensors'), 'rb').read()
    with open(os.path.join(export, 'model.safetensors'), 'wb') as f:
        f.write(weights[:len(weights) // 2])
    assert validate_command.main(['--checkpoint', export, '--data-layout', 'imagefolder',
                                  '--data-dir', os.path.join(data_dir, 'validation'), '--workers', '0']) == 2
    assert convert.main([export, str(tmp_path / 'out')]) == 2
    errors = capsys.readouterr().err.strip().splitlines()
    assert len(errors) == 2 and all('model.safetensors' in line for line in errors)
    assert not any('cannot be built with these arguments' in line for line in errors)


def test_resume_auto_without_config_continues_with_the_run_s_own_config(finished_run, tmp_path, caplog):
    """The default recipe (CSwin, 8 loader workers) was built, then refused minutes later."""
    run_dir = _copy(finished_run, tmp_path)
    with caplog.at_level(logging.INFO):
        assert main(['--output', run_dir, '--resume', 'auto']) == 0
    assert f'no --config given: continuing the run with its own {os.path.join(run_dir, "config.yaml")}' in caplog.text
    assert 'finished after 2 epochs' in caplog.text


def test_a_fresh_run_over_records_without_checkpoints_says_what_they_are(data_dir, finished_run, tmp_path, caplog):
    """It said lines "past the checkpoint resumed from" were moved and wrote config.before_step_00000000.yaml."""
    run_dir = str(tmp_path / 'run')
    os.makedirs(run_dir)
    for name in ('metrics.jsonl', 'config.yaml'):
        with open(os.path.join(finished_run, name), 'rb') as source, open(os.path.join(run_dir, name), 'wb') as f:
            f.write(source.read())
    argv = [*_overrides(data_dir, **{'train.epochs': 1}), '--output', run_dir, '--resume', 'auto']
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert 'past the checkpoint resumed from' not in caplog.text
    assert ('metrics.jsonl: 2 line(s) of an earlier start that left no checkpoint (epoch 1, 2) are moved to '
            'metrics.jsonl.orphaned') in caplog.text
    assert 'config.yaml: the config of an earlier start that left no checkpoint is kept as config.yaml.orphaned' \
        in caplog.text
    assert not [name for name in os.listdir(run_dir) if name.startswith('config.before_step')]
    assert yaml.safe_load(open(os.path.join(run_dir, 'config.yaml.orphaned')))['train']['epochs'] == 2


def test_cleared_temporaries_are_named_only_when_gone(data_dir, finished_run, tmp_path, caplog):
    run_dir = _copy(finished_run, tmp_path)
    os.makedirs(tmp_path / 'elsewhere')
    link = os.path.join(run_dir, 'checkpoints', '.tmp-removed-step_00000030')
    os.symlink(tmp_path / 'elsewhere', link)
    os.makedirs(os.path.join(run_dir, 'checkpoints', '.tmp-step_00000009'))
    with caplog.at_level(logging.INFO):
        assert main(['--config', os.path.join(run_dir, 'config.yaml'), '--output', run_dir, '--resume', 'auto']) == 0
    assert 'cleared what an interrupted write left: .tmp-step_00000009' in caplog.text
    assert '.tmp-removed-step_00000030' not in caplog.text and os.path.islink(link)


def test_a_new_run_refused_by_the_file_system_is_not_told_to_resume(tmp_path, caplog, monkeypatch):
    def refused(*args, **kwargs):
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(tmp_path / 'run' / 'config.yaml'))
    monkeypatch.setattr(train_command, 'train', refused)
    assert main(['--output', str(tmp_path / 'run'), 'train.epochs=1']) == 4
    message = caplog.records[-1].getMessage()
    assert 'Read-only file system' in message and '--resume auto' not in message
    assert 'start the run again' in message


def test_folders_of_the_user_in_checkpoints_are_never_taken_pruned_or_set_aside(data_dir, finished_run, tmp_path,
                                                                                caplog):
    """A folder not named as the trainer names its checkpoints counted as one: a copy of a checkpoint was pruned
    with the run's (keep_last) or resumed from, and a folder of notes was moved to checkpoints/unreadable/."""
    run_dir = _copy(finished_run, tmp_path)
    root = os.path.join(run_dir, 'checkpoints')
    backup = os.path.join(root, 'epoch_0002-backup')
    shutil.copytree(os.path.join(root, 'epoch_0002'), backup)
    with open(os.path.join(backup, 'meta.json')) as f:  # it would be the newest of the run, were it counted
        meta = json.load(f)
    meta['progress']['step'] += 100
    with open(os.path.join(backup, 'meta.json'), 'w') as f:
        json.dump(meta, f)
    notes = os.path.join(root, 'notes')
    os.makedirs(notes)
    with open(os.path.join(notes, 'todo.txt'), 'w') as f:
        f.write('compare with the authors\' run\n')
    before = {name: sorted(os.listdir(os.path.join(root, name))) for name in ('epoch_0002-backup', 'notes')}
    argv = [*_overrides(data_dir, **{'checkpoint.keep_last': 1, 'train.epochs': 3}), '--output', run_dir,
            '--resume', 'auto']
    with caplog.at_level(logging.INFO):
        assert main(argv) == 0
    assert 'resumed from ' + os.path.join(root, 'epoch_0002') + ':' in caplog.text
    assert not os.path.exists(os.path.join(root, 'unreadable'))
    assert {name: sorted(os.listdir(os.path.join(root, name))) for name in before} == before
    assert _names(run_dir)[-1] == 'epoch_0003'  # the run's own pruned down to keep_last (and the best)
    assert 'epoch_0002-backup' not in _names(run_dir)
