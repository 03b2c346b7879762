"""Training runs in the tests: overrides that make any config a seconds-long CPU run, a checkpoint's ``meta.json``,
and the comparison of a resumed run with an uninterrupted one."""
import dataclasses
import json
import os

import torch
from safetensors.torch import load_file
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN_KWARGS

from lipsformer.training.train_state import FORMAT_VERSION, META_FILE, Progress


def write_checkpoint_meta(folder: str | os.PathLike, step: int) -> None:
    """A training checkpoint's ``meta.json`` at optimizer update ``step``: what makes a folder a checkpoint."""
    os.makedirs(folder, exist_ok=True)
    meta = dict(format=FORMAT_VERSION, name=os.path.basename(folder), progress=dataclasses.asdict(Progress(step=step)))
    with open(os.path.join(folder, META_FILE), 'w') as f:
        json.dump(meta, f)


def assert_same_run(run_dir: str, reference: str, last: str) -> None:
    """The final raw and EMA weights and the metrics of ``reference`` (an uninterrupted run), timings aside."""
    for name in ('model.safetensors', 'ema.safetensors'):
        expected = load_file(os.path.join(reference, 'checkpoints', last, name))
        actual = load_file(os.path.join(run_dir, 'checkpoints', last, name))
        assert all(torch.equal(expected[k], actual[k]) for k in expected), f'{name} differs from the reference'
    untimed = ('images_per_s', 'epoch_time_s', 'peak_memory_mb')
    lines = [[{k: v for k, v in json.loads(line).items() if k not in untimed} for line in open(
        os.path.join(folder, 'metrics.jsonl'))] for folder in (run_dir, reference)]
    assert lines[0] == lines[1]


def tiny_overrides(data_dir: str, **extra: object) -> list[str]:
    """Overrides that make any config a seconds-long CPU run on a :func:`make_image_folder` tree."""
    settings: dict[str, object] = {
        'model.name': SMALLEST_MODEL, 'model.kwargs': SMALLEST_SWIN_KWARGS, 'model.img_size': 32, 'model.in_chans': 1,
        'model.drop_path_rate': 0.1, 'data.dataset': "''", 'data.data_dir': data_dir, 'data.train_split': 'train',
        'data.val_split': 'validation', 'data.num_workers': 0, 'data.mean': '[0.5]',
        'data.std': '[0.5]', 'data.crop_pct': 1.0, 'augment.auto_augment': 'null', 'augment.reprob': 0.25,
        'augment.scale': '[0.6, 1.0]', 'train.batch_size': 8, 'train.epochs': 2, 'train.progress_bar': False,
        'train.log_interval': 2, 'optimizer.lr': 2e-3, 'optimizer.lr_base_batch_size': 'null',
        'ema.decay': 0.9, 'ema.reference_batch_size': 'null', 'log.trackers': '[]', 'log.plots': False,
    }
    settings.update(extra)
    return [f'{key}={value}' for key, value in settings.items()]
