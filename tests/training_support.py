"""Tiny real-image datasets and configs for the training tests.

Images come from Fashion-MNIST (the Debian package's IDX files, /usr/share/datasets/fashion-mnist) when it is
installed; otherwise from class-dependent synthetic patterns, so the tests never skip for lack of data.
"""
import collections
import contextlib
import dataclasses
import io
import json
import os
import signal
import socket
import subprocess
import sys
import tarfile

import numpy as np
import torch
from PIL import Image
from safetensors.torch import load_file
from timm.models import register_model
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN_KWARGS
from torch import nn

from lipsformer.data import DEBIAN_FASHION_MNIST, read_fashion_mnist
from lipsformer.training import run_lock
from lipsformer.training.train_state import FORMAT_VERSION, META_FILE, Progress

RUN_LOCK_MODULE = run_lock.__file__


@contextlib.contextmanager
def single_thread():
    """Run torch on one thread: the tiny test models are fastest that way, most of all on a shared machine."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def subprocess_env(**extra: str) -> dict[str, str]:
    """Environment for a training subprocess: one thread, and this folder importable (before the ``PYTHONPATH`` the
    tests run with, which may name the checkout to test)."""
    path = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get('PYTHONPATH')]))
    return {**os.environ, 'OMP_NUM_THREADS': '1', 'PYTHONPATH': path, **extra}


# Takes the lock (run_lock.py loaded on its own: no torch to import) and lets it go when the file argv[3] exists.
_HOLDER = '''
import importlib.util, os, sys, time
spec = importlib.util.spec_from_file_location('run_lock', sys.argv[1])
run_lock = importlib.util.module_from_spec(spec)
spec.loader.exec_module(run_lock)
lock = run_lock.RunLock(sys.argv[2])
lock.acquire()
print('HELD', flush=True)
while not os.path.exists(sys.argv[3]):
    time.sleep(0.05)
lock.release()
'''


def hold_lock(run_dir: str, release: str) -> subprocess.Popen:
    """A process that takes the run folder's lock (as a run does) and lets it go when the file ``release`` exists."""
    holder = subprocess.Popen([sys.executable, '-c', _HOLDER, RUN_LOCK_MODULE, run_dir, release],
                              stdout=subprocess.PIPE, text=True, env=subprocess_env())
    assert holder.stdout.readline() == 'HELD\n'
    return holder


def free_port() -> int:
    """A free local TCP port for ``accelerate launch --main_process_port`` (port 0 hangs torch 2.6's rendezvous)."""
    with socket.socket() as s:
        s.bind(('127.0.0.1', 0))
        return s.getsockname()[1]


def grayscale_images(num_classes: int, per_class: int, split: str, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    """``per_class`` 28x28 uint8 images for each of the first ``num_classes`` classes."""
    if os.path.isdir(DEBIAN_FASHION_MNIST):
        images, labels = (t.numpy() for t in read_fashion_mnist('train' if split == 'train' else 'test'))
        chosen = []
        for label in range(num_classes):
            chosen += [(images[i], label) for i in np.flatnonzero(labels == label)[:per_class]]
        return chosen
    rng = np.random.default_rng(seed + (split == 'train'))
    chosen = []
    for label in range(num_classes):
        for _ in range(per_class):
            image = rng.integers(0, 60, (28, 28))
            image[:, 3 * label:3 * label + 6] += 180  # a class-specific vertical bar
            chosen.append((image.astype(np.uint8), label))
    return chosen


def make_image_folder(root: str, num_classes: int = 4, train_per_class: int = 12, val_per_class: int = 6) -> str:
    """An ImageFolder tree ``root/{train,validation}/class_<k>/<i>.png``; returns ``root``."""
    for split, per_class in (('train', train_per_class), ('validation', val_per_class)):
        for index, (pixels, label) in enumerate(grayscale_images(num_classes, per_class, split)):
            folder = os.path.join(root, split, f'class_{label}')
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(pixels, mode='L').save(os.path.join(folder, f'{index:05d}.png'))
    return root


def make_webdataset(root: str, num_classes: int = 4, train_per_class: int = 12, val_per_class: int = 6) -> str:
    """The same images as :func:`make_image_folder` as WebDataset shards (``<key>.png`` + ``<key>.cls``) with the
    ``_info.json`` timm's ``wds/`` reader reads: two training shards, one validation shard."""
    os.makedirs(root, exist_ok=True)
    info: dict = {'name': 'tiny', 'splits': {}}
    for split, per_class, shards in (('train', train_per_class, 2), ('validation', val_per_class, 1)):
        samples = grayscale_images(num_classes, per_class, split)
        names, lengths = [], []
        for shard in range(shards):
            name = f'{split}-{shard:06d}.tar'
            part = samples[shard::shards]
            with tarfile.open(os.path.join(root, name), 'w') as tar:
                for index, (pixels, label) in enumerate(part):
                    png = io.BytesIO()
                    Image.fromarray(pixels, mode='L').save(png, format='PNG')
                    for suffix, data in (('png', png.getvalue()), ('cls', str(label).encode())):
                        member = tarfile.TarInfo(f'{split}_{shard}_{index:05d}.{suffix}')
                        member.size = len(data)
                        tar.addfile(member, io.BytesIO(data))
            names.append(name)
            lengths.append(len(part))
        info['splits'][split] = dict(name=split, num_samples=sum(lengths), filenames=names, shard_lengths=lengths)
    with open(os.path.join(root, '_info.json'), 'w') as f:
        json.dump(info, f)
    return root


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


# Training forward calls (counted from 1) whose output the probe model turns into NaN; a subprocess reads them from
# NAN_PROBE_CALLS ("3,9") and, when NAN_PROBE_RANK is set, only that process produces them.
NAN_AT_CALLS: set[int] = {int(c) for c in os.environ.get('NAN_PROBE_CALLS', '').split(',') if c}
# Signals the probe model sends its own process at a forward call: {('train' or 'eval', call): signal}; a subprocess
# reads them from SIGNAL_PROBE ("eval:1:SIGTERM,train:4:SIGINT") and, when SIGNAL_PROBE_RANK is set, only that
# process sends them.
SIGNALS_AT_CALLS: dict[tuple[str, int], signal.Signals] = {
    (mode, int(call)): signal.Signals[name] for mode, call, name in (
        item.split(':') for item in os.environ.get('SIGNAL_PROBE', '').split(',') if item)}
# Forward calls of the probe models of this process so far, by mode.
PROBE_CALLS: collections.Counter = collections.Counter()


def _this_rank(variable: str) -> bool:
    return os.environ.get(variable) in (None, os.environ.get('RANK', '0'))


class NanProbeNet(nn.Module):
    """A tiny convnet that returns NaN logits on the training calls listed in :data:`NAN_AT_CALLS` and signals its
    process at the calls listed in :data:`SIGNALS_AT_CALLS` (both counted per model, from 1)."""

    def __init__(self, num_classes: int = 4, in_chans: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, 8, 3, stride=2)
        self.head = nn.Linear(8, num_classes)
        self.calls: collections.Counter = collections.Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.conv(x).relu().mean((2, 3)))
        mode = 'train' if self.training else 'eval'
        self.calls[mode] += 1
        PROBE_CALLS[mode] += 1
        if mode == 'train' and self.calls[mode] in NAN_AT_CALLS and _this_rank('NAN_PROBE_RANK'):
            logits = logits * float('nan')
        signum = SIGNALS_AT_CALLS.get((mode, self.calls[mode]))
        if signum is not None and _this_rank('SIGNAL_PROBE_RANK'):
            os.kill(os.getpid(), signum)
        return logits


@register_model
def nan_probe_net(pretrained: bool = False, **kwargs) -> NanProbeNet:
    """Registered with timm so that configs can name it (model.name=nan_probe_net)."""
    return NanProbeNet(**{k: v for k, v in kwargs.items() if k in ('num_classes', 'in_chans')})


class AlphaCap:
    """A stand-in Lipschitz constraint for the lipschitz.* hook: caps every |alpha| and counts its calls."""

    def __init__(self, model: nn.Module, max_alpha: float):
        self.alphas = [p for name, p in model.named_parameters() if '.alpha' in name and name.endswith('.gamma')]
        self.max_alpha = max_alpha
        self.calls = 0

    def __call__(self) -> None:
        with torch.no_grad():
            for alpha in self.alphas:
                alpha.clamp_(-self.max_alpha, self.max_alpha)
        self.calls += 1

    def state_dict(self) -> dict[str, int]:
        return {'calls': self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state['calls']
