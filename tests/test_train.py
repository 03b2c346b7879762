"""The training loop end to end on a tiny LipsFormer and a tiny real-image folder: the run folder contract that
validate.py reads, timm-loadable exports, and resuming (bit-exact at an epoch boundary and mid-epoch)."""
import json
import os
import stat
import sys

import pytest
import timm
import torch
from image_data import make_webdataset
from PIL import Image
from safetensors.torch import load_file
from tiny_models import SMALLEST_MODEL
from training_support import tiny_overrides

import lipsformer  # noqa: F401
from lipsformer.training import load_config, train
from lipsformer.training.finish import write_plots
from lipsformer.training.overhead import main as overhead_main
from lipsformer.training.train_state import list_checkpoints
from lipsformer.utils.io import default_file_mode
from lipsformer.weights.weight_files import CheckpointError
from lipsformer.weights.weight_files import load_file as load_file_any

pytestmark = pytest.mark.usefixtures('one_thread')

# 4 classes x 12 training images, batch 8: 6 updates per epoch; 24 validation images.
TRAIN_IMAGES, VAL_IMAGES, UPDATES_PER_EPOCH = 48, 24, 6
# No random augmentation or stochastic depth: the order of batches alone decides the final weights.
DETERMINISTIC = {'augment.reprob': 0.0, 'augment.scale': '[1.0, 1.0]', 'augment.ratio': '[1.0, 1.0]',
                 'augment.hflip': 0.0, 'augment.color_jitter': 0.0, 'augment.mixup': 0.0, 'augment.cutmix': 0.0,
                 'model.drop_path_rate': 0.0}


def run(data_dir: str, run_dir: str, resume: str | None = None, trusted_callables: tuple[str, ...] = (),
        **extra) -> dict:
    return train(load_config(None, tiny_overrides(data_dir, **extra)), run_dir, resume=resume,
                 trusted_callables=trusted_callables)


@pytest.fixture(scope='module')
def reference_run(data_dir, tmp_path_factory):
    """Two epochs with mixup, random erasing and drop path; a checkpoint every 4 updates, all kept."""
    run_dir = str(tmp_path_factory.mktemp('reference'))
    summary = run(data_dir, run_dir, **{'checkpoint.every_n_steps': 4, 'checkpoint.keep_last': 10})
    return run_dir, summary


def _weights(folder: str, name: str = 'model.safetensors') -> dict[str, torch.Tensor]:
    return load_file(os.path.join(folder, name))


def _assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f'{len(different)} tensors differ, e.g. {different[:3]}'


def test_run_folder_holds_what_validation_reads(reference_run):
    run_dir, summary = reference_run
    assert summary['status'] == 'finished' and summary['ranks_identical']
    lines = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    assert [line['epoch'] for line in lines] == [1, 2]
    assert [line['step'] for line in lines] == [UPDATES_PER_EPOCH, 2 * UPDATES_PER_EPOCH]
    for line in lines:
        assert line['val_samples'] == VAL_IMAGES
        for key in ('train_loss', 'val_top1', 'val_top5', 'ema_val_top1', 'lr', 'images_per_s', 'peak_memory_mb'):
            assert key in line
        assert 0 <= line['val_top1'] <= line['val_top5'] <= 100
        assert {f'alpha/stage{i}/{s}' for i in range(4) for s in ('mean', 'std')} <= line.keys()
    assert lines[-1]['lr'] == pytest.approx(2e-5)  # the cosine ends at min_lr
    config = load_config(os.path.join(run_dir, 'config.yaml'))
    assert config.model.name == SMALLEST_MODEL and config.train.epochs == 2
    names = sorted(os.path.basename(folder) for _, folder in list_checkpoints(run_dir))
    assert names == ['epoch_0001', 'epoch_0002', 'step_00000004', 'step_00000008']
    last = os.path.join(run_dir, 'checkpoints', 'epoch_0002')
    assert {'model.safetensors', 'ema.safetensors', 'optimizer.pt', 'trainer_state.pt', 'rng_state_0.pt',
            'meta.json'} == set(os.listdir(last))
    best = json.load(open(os.path.join(run_dir, 'checkpoints', 'best.json')))
    assert best['metric'] == 'ema_val_top1'
    assert best['value'] == max(line['ema_val_top1'] for line in lines)
    _assert_same(_weights(last), _weights(os.path.join(run_dir, 'export', 'last')))
    _assert_same(_weights(last, 'ema.safetensors'), _weights(os.path.join(run_dir, 'export', 'last'),
                                                             'model_ema.safetensors'))
    _assert_same(_weights(os.path.join(run_dir, 'checkpoints', best['name'])),
                 _weights(os.path.join(run_dir, 'export', 'best')))
    modes = {os.path.relpath(path, run_dir): stat.S_IMODE(os.stat(path).st_mode)
             for path in (os.path.join(folder, name) for folder, _, files in os.walk(run_dir) for name in files)}
    assert any(name.endswith('.safetensors') for name in modes)
    assert {name: f'{mode:o}' for name, mode in modes.items() if mode != default_file_mode()} == {}  # safetensors too


def test_exports_load_with_timm(reference_run, data_dir):
    run_dir, _ = reference_run
    export = os.path.join(run_dir, 'export', 'best')
    expected = _weights(export)
    by_folder = timm.create_model(f'local-dir:{export}', pretrained=True)
    _assert_same(by_folder.state_dict(), expected)
    config = json.load(open(os.path.join(export, 'config.json')))
    assert config['architecture'] == SMALLEST_MODEL and config['num_classes'] == 4
    assert config['label_names'] == [f'class_{i}' for i in range(4)]
    by_file = timm.create_model(SMALLEST_MODEL, pretrained=True, **config['model_args'],
                                pretrained_cfg_overlay=dict(file=os.path.join(export, 'model.safetensors'),
                                                            num_classes=4))
    _assert_same(by_file.state_dict(), expected)
    images = torch.randn(2, 1, 32, 32)
    assert torch.equal(by_folder.eval()(images), by_file.eval()(images))


def test_resume_at_an_epoch_boundary_reproduces_the_run_bit_for_bit(reference_run, data_dir, tmp_path):
    run_dir, _ = reference_run
    resumed = str(tmp_path / 'resumed')
    summary = run(data_dir, resumed, resume=os.path.join(run_dir, 'checkpoints', 'epoch_0001'),
                  **{'checkpoint.every_n_steps': 4, 'checkpoint.keep_last': 10})
    assert summary['step'] == 2 * UPDATES_PER_EPOCH
    for name in ('model.safetensors', 'ema.safetensors'):
        _assert_same(_weights(os.path.join(run_dir, 'checkpoints', 'epoch_0002'), name),
                     _weights(os.path.join(resumed, 'checkpoints', 'epoch_0002'), name))
    original = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    continued = [json.loads(line) for line in open(os.path.join(resumed, 'metrics.jsonl'))]
    assert [line['epoch'] for line in continued] == [1, 2]  # the history comes with the checkpoint
    for key in ('train_loss', 'val_top1', 'ema_val_top1', 'val_loss'):
        assert continued[1][key] == original[1][key]


def test_resume_mid_epoch_reproduces_the_run_with_augmentation_drop_path_and_loader_workers(data_dir, tmp_path):
    """Random crops and flips in two loader workers, random erasing, mixup / CutMix and drop path: the resumed run
    draws the same random numbers for the rest of the epoch, whichever worker transforms which image."""
    settings = {'checkpoint.every_n_steps': 4, 'checkpoint.keep_last': 10, 'data.num_workers': 2,
                'augment.hflip': 0.5, 'augment.vflip': 0.5}
    whole = str(tmp_path / 'whole')
    run(data_dir, whole, **settings)
    mid_epoch = os.path.join(whole, 'checkpoints', 'step_00000008')  # update 2 of the 6 in epoch 2
    assert json.load(open(os.path.join(mid_epoch, 'meta.json')))['progress']['batch_in_epoch'] == 2
    resumed = str(tmp_path / 'resumed')
    run(data_dir, resumed, resume=mid_epoch, **{**settings, 'data.num_workers': 1})  # worker count does not matter
    for name in ('model.safetensors', 'model_ema.safetensors'):
        _assert_same(_weights(os.path.join(whole, 'export', 'last'), name),
                     _weights(os.path.join(resumed, 'export', 'last'), name))
    original = [json.loads(line) for line in open(os.path.join(whole, 'metrics.jsonl'))]
    continued = [json.loads(line) for line in open(os.path.join(resumed, 'metrics.jsonl'))]
    for key in ('train_loss', 'val_loss', 'val_top1', 'ema_val_top1'):  # the epoch's loss includes its first part
        assert continued[1][key] == original[1][key]


def test_an_existing_run_is_never_overwritten_and_resume_checks_the_batch_layout(reference_run, data_dir, tmp_path):
    run_dir, _ = reference_run
    before = {name: os.path.getmtime(os.path.join(run_dir, name)) for name in ('config.yaml', 'metrics.jsonl')}
    with pytest.raises(CheckpointError, match='already holds checkpoints of a run; continue it with --resume auto'):
        run(data_dir, run_dir)
    assert before == {name: os.path.getmtime(os.path.join(run_dir, name)) for name in before}
    with pytest.raises(CheckpointError, match='another batch layout .*global_batch_size 8 -> 4'):
        run(data_dir, str(tmp_path / 'other'), resume=os.path.join(run_dir, 'checkpoints', 'epoch_0001'),
            **{'train.batch_size': 4})
    with pytest.raises(CheckpointError, match='no such folder'):
        run(data_dir, str(tmp_path / 'other'), resume=str(tmp_path / 'missing'))


def test_resume_auto_on_a_finished_run_only_exports(reference_run, data_dir):
    run_dir, _ = reference_run
    summary = run(data_dir, run_dir, resume='auto', **{'checkpoint.every_n_steps': 4, 'checkpoint.keep_last': 10})
    assert summary['status'] == 'finished' and summary['step'] == 2 * UPDATES_PER_EPOCH
    assert len(open(os.path.join(run_dir, 'metrics.jsonl')).readlines()) == 2


def test_accumulation_precision_memory_options_and_the_lipschitz_hook(data_dir, tmp_path):
    run_dir = str(tmp_path / 'run')
    summary = run(data_dir, run_dir, trusted_callables=('probe_models:AlphaCap',), **{
        'train.grad_accum_steps': 2, 'train.mixed_precision': 'bf16', 'optimizer.clip_grad': 1.0,
        'model.channels_last': True, 'model.grad_checkpointing': True, 'lipschitz.enabled': True,
        'lipschitz.target': 'probe_models:AlphaCap', 'lipschitz.kwargs': '{max_alpha: 0.2}'})
    updates = UPDATES_PER_EPOCH // 2
    assert summary['step'] == 2 * updates
    checkpoint = os.path.join(run_dir, 'checkpoints', 'epoch_0002')
    assert load_file_any(os.path.join(checkpoint, 'trainer_state.pt'))['extra']['lipschitz'] == {'calls': 2 * updates}
    alphas = [v for k, v in _weights(checkpoint).items() if '.alpha' in k and k.endswith('.gamma')]
    assert alphas and all(a.abs().max() <= 0.2 for a in alphas)  # they start at 1/sum(depths) = 0.25
    assert json.load(open(os.path.join(checkpoint, 'meta.json')))['geometry']['global_batch_size'] == 16


def test_plots_of_loss_accuracy_and_alpha(reference_run, tmp_path, monkeypatch, caplog):
    run_dir, _ = reference_run
    history = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    with monkeypatch.context() as patch:
        patch.setitem(sys.modules, 'matplotlib', None)  # as if it were not installed
        assert write_plots(history, str(tmp_path / 'none')) == []
    assert 'matplotlib is not installed' in caplog.text
    pytest.importorskip('matplotlib', reason='plots are an optional extra')
    written = write_plots(history, str(tmp_path))
    assert [os.path.basename(path) for path in written] == ['loss.png', 'accuracy.png', 'alpha.png']
    for path in written:
        with Image.open(path) as image:
            assert image.format == 'PNG' and image.width >= 600


def test_webdataset_shards_train_and_resume_mid_epoch(tmp_path):
    pytest.importorskip('webdataset', reason='wds/ datasets need the webdataset package')
    shards = make_webdataset(str(tmp_path / 'shards'))
    settings = {'data.dataset': 'wds/tiny', 'data.train_num_samples': TRAIN_IMAGES, 'data.val_num_samples': VAL_IMAGES,
                'model.num_classes': 4, 'checkpoint.every_n_steps': 4, 'checkpoint.keep_last': 10,
                'data.num_workers': 1, **DETERMINISTIC}  # timm seeds a stream's shuffle from its loader worker
    summary = run(shards, str(tmp_path / 'whole'), **settings)
    assert summary['step'] == 2 * UPDATES_PER_EPOCH and summary['final_metrics']['val_samples'] == VAL_IMAGES
    run(shards, str(tmp_path / 'resumed'), resume=str(tmp_path / 'whole' / 'checkpoints' / 'step_00000008'),
        **settings)  # a stream cannot seek: the resumed epoch reads past the batches it had used
    _assert_same(_weights(str(tmp_path / 'whole' / 'export' / 'last')),
                 _weights(str(tmp_path / 'resumed' / 'export' / 'last')))


def test_loop_overhead_tool_measures_both_rates(data_dir, capsys):
    result = overhead_main(['--config', os.path.join(os.path.dirname(__file__), '..', 'configs', 'quickstart.yaml'),
                   '--updates', '5', '--warmup', '2', *tiny_overrides(data_dir)])
    assert result['bare_step_images_per_s'] > 0 and result['full_loop_images_per_s'] > 0
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])['model'] == SMALLEST_MODEL


def test_tensorboard_receives_the_epoch_metrics(data_dir, tmp_path):
    pytest.importorskip('tensorboard', reason='TensorBoard logging is optional')
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    run(data_dir, str(tmp_path / 'run'), **{'log.trackers': '[tensorboard]', 'checkpoint.export': False})
    events = EventAccumulator(str(tmp_path / 'run' / 'tensorboard' / 'lipsformer'))
    events.Reload()
    assert {'train_loss', 'val_top1', 'ema_val_top1', 'lr'} <= set(events.Tags()['scalars'])
    assert [event.step for event in events.Scalars('val_top1')] == [UPDATES_PER_EPOCH, 2 * UPDATES_PER_EPOCH]
