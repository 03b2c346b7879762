"""A training run's data from its config: its splits opened, sharded over processes, and batches on the device.

- Sources: timm datasets (``create_dataset``) with their transforms, read through :mod:`lipsformer.data`: which
  images each split means and the one class map of a run (:mod:`lipsformer.data.splits`), Fashion-MNIST unpacked from
  the Debian package when it is installed, so no network is needed, and unreadable images skipped without ending a
  run, and counted (:class:`lipsformer.data.RobustDataset`).
- Samplers: the training order depends only on (seed, epoch), never on global RNG state, so a resumed run visits the
  same images in the same order, and resuming mid-epoch yields exactly the images this process had not yet seen.
  Evaluation covers every image once over all processes and draws from no global random stream.
- Augmentation: the random transform of an image depends only on (seed, epoch, image), not on which loader worker
  runs it nor on what ran before, and random erasing is applied as each batch is taken (with mixup, in the step), so
  a run resumed at any update continues with the same random numbers as the run that was not interrupted.
- Batches: images leave the workers as uint8 and are normalised on the device by timm's ``PrefetchLoader``.
"""
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from timm.data import create_transform, resolve_data_config
from timm.data.loader import PrefetchLoader, fast_collate
from timm.data.random_erasing import RandomErasing
from timm.models import get_pretrained_cfg
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler

from ..data.datasets import PAD_INDEX
from ..data.sources import DataSource, open_split
from .config import Config
from .signals import ignore_stop_signals

_logger = logging.getLogger(__name__)


@dataclass
class InputSpec:
    """The resolved input pipeline settings (what timm calls the data config)."""
    input_size: tuple[int, int, int]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    interpolation: str
    crop_pct: float
    crop_mode: str

    def as_dict(self) -> dict[str, Any]:
        return dict(input_size=self.input_size, mean=self.mean, std=self.std, interpolation=self.interpolation,
                    crop_pct=self.crop_pct, crop_mode=self.crop_mode)


def resolve_input_spec(config: Config) -> InputSpec:
    """The model's default pretrained data config (looked up by name) overridden by whatever the config sets."""
    pretrained_cfg = get_pretrained_cfg(config.model.name)
    args = dict(in_chans=config.model.in_chans, img_size=config.model.img_size, mean=config.data.mean,
                std=config.data.std, crop_pct=config.data.crop_pct, interpolation=config.data.interpolation)
    resolved = resolve_data_config(args=args, pretrained_cfg=pretrained_cfg.to_dict() if pretrained_cfg else None)
    return InputSpec(input_size=tuple(resolved['input_size']), mean=tuple(resolved['mean']),
                     std=tuple(resolved['std']), interpolation=resolved['interpolation'],
                     crop_pct=resolved['crop_pct'], crop_mode=resolved['crop_mode'])











def create_split(config: Config, spec: InputSpec, is_training: bool,
                 class_map: Mapping[str, int] | None = None) -> Dataset:
    """The run's training or validation split with its transform attached (:func:`lipsformer.data.open_split` with
    the config's ``data.*``).

    Args:
        config: The run's config.
        spec: Input settings for the transforms.
        is_training: The training split (else the validation split).
        class_map: The training split's class map, with which an image-folder validation split is labelled.

    Raises:
        DatasetNotFoundError: The dataset or the split is not there.
        DatasetError: The split's classes do not fit the run's class map.
    """
    data = config.data
    source = DataSource(dataset=data.dataset, data_dir=data.data_dir, download=data.download,
                        class_map=data.class_map or '', in_chans=config.model.in_chans,
                        batch_size=config.train.batch_size, seed=config.train.seed, num_workers=data.num_workers)
    key = 'train_split' if is_training else 'val_split'
    transform = create_train_transform(config, spec) if is_training else create_eval_transform(spec)
    return open_split(source, getattr(data, key), f'data.{key}', is_training, transform, class_map=class_map,
                      num_samples=data.train_num_samples if is_training else data.val_num_samples)


def create_train_transform(config: Config, spec: InputSpec) -> Any:
    """timm's training transform, leaving random erasing to :class:`TrainBatches` (it runs on the device)."""
    augment = config.augment
    return create_transform(
        spec.input_size, is_training=True, scale=tuple(augment.scale), ratio=tuple(augment.ratio),
        hflip=augment.hflip, vflip=augment.vflip, color_jitter=augment.color_jitter,
        auto_augment=augment.auto_augment, interpolation=config.data.interpolation, mean=spec.mean, std=spec.std,
        use_prefetcher=True)


def create_eval_transform(spec: InputSpec) -> Any:
    interpolation = 'bicubic' if spec.interpolation == 'random' else spec.interpolation
    return create_transform(spec.input_size, is_training=False, interpolation=interpolation, mean=spec.mean,
                            std=spec.std, crop_pct=spec.crop_pct, crop_mode=spec.crop_mode, use_prefetcher=True)


class ShardedTrainSampler(Sampler[int]):
    """This process's share of a per-epoch permutation, every process getting the same number of samples.

    The permutation of ``range(dataset_size)`` is seeded by ``seed + epoch``; the first
    ``dataset_size // num_replicas * num_replicas`` entries are dealt round-robin to the processes (the few left
    over are dropped for this epoch, as DistributedSampler does), so no process waits on another at the end.
    """

    def __init__(self, dataset_size: int, num_replicas: int = 1, rank: int = 0, seed: int = 0, shuffle: bool = True):
        if dataset_size < num_replicas:
            raise ValueError(f'the training set has {dataset_size} images, fewer than the {num_replicas} processes')
        self.dataset_size = dataset_size
        self.num_replicas = num_replicas
        self.rank = rank
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.start = 0

    def set_epoch(self, epoch: int, start: int = 0) -> None:
        """Select the epoch's permutation and skip this process's first ``start`` samples of it."""
        self.epoch = epoch
        self.start = start

    def epoch_indices(self) -> list[int]:
        """All of this process's indices for the current epoch, from the beginning."""
        if self.shuffle:
            generator = torch.Generator()
            generator.manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.dataset_size, generator=generator)
        else:
            order = torch.arange(self.dataset_size)
        usable = self.dataset_size // self.num_replicas * self.num_replicas
        return order[self.rank:usable:self.num_replicas].tolist()

    def __iter__(self) -> Iterator[int]:
        return iter(self.epoch_indices()[self.start:])

    def __len__(self) -> int:
        return self.dataset_size // self.num_replicas - self.start


class ShardedEvalSampler(Sampler[int]):
    """Every sample exactly once over all processes, padded with :data:`PAD_INDEX` to equal counts.

    Equal counts keep collective operations inside a sharded model's forward (FSDP) in step; padded entries are
    labelled -1 by the dataset wrapper and ignored by the metrics, so no image is counted twice.
    """

    def __init__(self, dataset_size: int, num_replicas: int = 1, rank: int = 0):
        self.dataset_size = dataset_size
        self.num_replicas = num_replicas
        self.rank = rank

    def __iter__(self) -> Iterator[int]:
        padded = -(-self.dataset_size // self.num_replicas) * self.num_replicas
        indices = list(range(self.dataset_size)) + [PAD_INDEX] * (padded - self.dataset_size)
        return iter(indices[self.rank::self.num_replicas])

    def __len__(self) -> int:
        return -(-self.dataset_size // self.num_replicas)


class TrainBatches:
    """The training batches of each epoch, on the device and normalised, optionally starting part-way.

    Args:
        dataset: From :func:`create_split`.
        config: The run's config.
        spec: Input settings (mean / std for the on-device normalisation).
        device: Where batches go.
        num_replicas: Number of processes.
        rank: This process's index.
    """

    def __init__(self, dataset: Dataset, config: Config, spec: InputSpec, device: torch.device, num_replicas: int,
                 rank: int):
        self.dataset = dataset
        self.batch_size = config.train.batch_size
        self.seed = config.train.seed
        self.rank = rank
        self.iterable = isinstance(dataset, IterableDataset)
        self.sampler = None if self.iterable else ShardedTrainSampler(len(dataset), num_replicas, rank, self.seed)
        self.generator = torch.Generator()
        self.loader = DataLoader(
            dataset, batch_size=self.batch_size, sampler=self.sampler, num_workers=config.data.num_workers,
            collate_fn=fast_collate, pin_memory=config.data.pin_memory and device.type == 'cuda', drop_last=True,
            generator=self.generator, persistent_workers=False, worker_init_fn=ignore_stop_signals)
        augment = config.augment
        self.prefetcher = PrefetchLoader(self.loader, mean=spec.mean, std=spec.std, channels=spec.input_size[0],
                                         device=device)
        # Random erasing is applied as each batch is taken, not when the prefetcher reads ahead, so that its random
        # numbers are drawn in step order (what a checkpoint's RNG state can restore).
        self.random_erasing = RandomErasing(probability=augment.reprob, mode=augment.remode,
                                            max_count=augment.recount, device=device) if augment.reprob > 0 else None

    def __len__(self) -> int:
        """Micro-batches in a full epoch on this process."""
        if self.iterable:
            return len(self.loader)
        return len(self.dataset) // self.sampler.num_replicas // self.batch_size

    def epoch(self, epoch: int, start_batch: int = 0) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The batches of ``epoch`` from micro-batch ``start_batch`` on.

        Each image's random transform is seeded by (seed, epoch, image index); worker seeds (a stream's shuffle)
        come from a generator seeded by (seed, epoch, rank). Random erasing draws from the global generator of the
        device as each batch is taken.
        """
        self.generator.manual_seed((self.seed * 1_000_003 + epoch) * 1009 + self.rank)
        if self.iterable:
            self.dataset.set_epoch(epoch)
            if start_batch and self.loader.num_workers == 0:
                _logger.warning('resuming a stream mid-epoch without loader workers: timm seeds a stream\'s shuffle '
                                'per worker, so the rest of this epoch may not be the images not yet seen')
            iterator = iter(self.prefetcher)
            for _ in range(start_batch):  # a stream cannot seek: read past what this epoch already used
                next(iterator)
        else:
            self.dataset.augment_seed = (self.seed, epoch)
            self.sampler.set_epoch(epoch, start=start_batch * self.batch_size)
            iterator = iter(self.prefetcher)
        return self._erased(iterator)

    def _erased(self, batches: Iterator[tuple[torch.Tensor, torch.Tensor]]
                ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        for images, targets in batches:
            yield (images if self.random_erasing is None else self.random_erasing(images)), targets


def create_eval_loader(dataset: Dataset, config: Config, spec: InputSpec, device: torch.device,
                       num_replicas: int, rank: int) -> PrefetchLoader:
    """Evaluation batches covering every image once over all processes (targets -1 mark padding)."""
    batch_size = config.data.val_batch_size or 2 * config.train.batch_size
    sampler = None if isinstance(dataset, IterableDataset) else ShardedEvalSampler(len(dataset), num_replicas, rank)
    # Its own generator: a loader draws its workers' base seed when iterated, from torch's global generator unless
    # given one, and an evaluation must leave the training's random numbers as they were.
    loader = DataLoader(dataset, batch_size=batch_size, sampler=sampler, num_workers=config.data.num_workers,
                        collate_fn=fast_collate, pin_memory=config.data.pin_memory and device.type == 'cuda',
                        drop_last=False, persistent_workers=False, worker_init_fn=ignore_stop_signals,
                        generator=torch.Generator().manual_seed(config.train.seed))
    return PrefetchLoader(loader, mean=spec.mean, std=spec.std, channels=spec.input_size[0], device=device)
