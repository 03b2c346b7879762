"""Training and evaluation data: where datasets come from, how they are sharded, and batches on the device.

- Sources: timm datasets (``create_dataset``) with their transforms; which images each split means, and the one class
  map of a run, are decided by :mod:`.splits`; Fashion-MNIST is unpacked from the Debian package when it is installed,
  so no network is needed; unreadable images are skipped without ending a run, and counted (a split without one readable
  image among many is a :class:`~.splits.DatasetError`).
- Samplers: the training order depends only on (seed, epoch), never on global RNG state, so a resumed run visits the
  same images in the same order, and resuming mid-epoch yields exactly the images this process had not yet seen.
  Evaluation covers every image once over all processes and draws from no global random stream.
- Augmentation: the random transform of an image depends only on (seed, epoch, image), not on which loader worker
  runs it nor on what ran before, and random erasing is applied as each batch is taken (with mixup, in the step), so
  a run resumed at any update continues with the same random numbers as the run that was not interrupted.
- Batches: images leave the workers as uint8 and are normalised on the device by timm's ``PrefetchLoader``.
"""
import contextlib
import gzip
import logging
import os
import random
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image
from timm.data import create_dataset, create_transform, resolve_data_config
from timm.data.loader import PrefetchLoader, fast_collate
from timm.data.random_erasing import RandomErasing
from timm.data.readers.class_map import load_class_map
from timm.models import get_pretrained_cfg
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info
from torchvision import transforms

from ..utils.io import atomic_open
from .config import Config
from .signals import ignore_stop_signals
from .splits import (
    DatasetError,
    DatasetNotFoundError,
    check_split_classes,
    check_torchvision_split,
    class_folders_without_images,
    listing,
    loose_images,
    split_folder,
)

_logger = logging.getLogger(__name__)

# How many following images to try in place of an unreadable one before giving up.
_MAX_CONSECUTIVE_BAD_IMAGES = 50
# Index the evaluation sampler yields for padding; the dataset wrapper answers it with a sample labelled -1.
PAD_INDEX = -1
DEBIAN_FASHION_MNIST = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
                       't10k-labels-idx1-ubyte')


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


class ImageMode:
    """Convert a PIL image to a colour mode (torchvision datasets hand out Fashion-MNIST as 'L')."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, image: Image.Image) -> Image.Image:
        return image if image.mode == self.mode else image.convert(self.mode)


def _mix(*values: int) -> int:
    """A 32-bit seed from integers (a splitmix64-style hash: nearby keys give unrelated seeds)."""
    mixed = 0x9E3779B97F4A7C15
    for value in values:
        mixed = ((mixed ^ value) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
        mixed = ((mixed ^ (mixed >> 31)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (mixed ^ (mixed >> 29)) & 0xFFFFFFFF


@contextlib.contextmanager
def seeded_randomness(*key: int) -> Iterator[None]:
    """Python's, NumPy's and torch's CPU generators seeded from ``key`` inside.

    In the main process (no loader workers) they are put back as they were afterwards, so that the training's own
    random numbers (mixup, drop path, random erasing) do not depend on when images are loaded; a loader worker's
    generators serve its images only and are left as they are (saving and restoring NumPy's state costs more than
    seeding).
    """
    in_main_process = get_worker_info() is None
    if in_main_process:
        state = random.getstate(), np.random.get_state(), torch.default_generator.get_state()
    seed = _mix(*key)
    random.seed(seed)
    np.random.seed(seed)
    torch.default_generator.manual_seed(seed)  # torch.manual_seed would seed every device too, far slower
    try:
        yield
    finally:
        if in_main_process:
            random.setstate(state[0])
            np.random.set_state(state[1])
            torch.default_generator.set_state(state[2])


class RobustDataset(Dataset):
    """Wraps a map-style dataset: padding indices and unreadable images never crash a run.

    An unreadable image is logged with its file name, counted (:meth:`skipped_images`) and replaced by the next
    readable one; during evaluation the replacement is labelled -1 so the metrics skip it instead of counting an image
    twice. :data:`PAD_INDEX` (from the evaluation sampler) gives a sample labelled -1 as well. With
    :attr:`augment_seed` set (``(seed, epoch)``), each training image is transformed with random generators seeded by
    it and the image's index.

    Args:
        dataset: The map-style dataset.
        is_training: A training split (replacements keep their labels) or an evaluation one.
        where: The split, for messages (``data.train_split 'train' under '/data'``).
        loader_workers: Loader worker processes that will read it; the count of skipped images is kept in shared
            memory, one slot per worker, so that the process that owns the dataset sees every worker's skips.
    """

    def __init__(self, dataset: Dataset, is_training: bool, where: str = 'the dataset', loader_workers: int = 0):
        self.dataset = dataset
        self.is_training = is_training
        self.where = where
        self.augment_seed: tuple[int, int] | None = None
        self.skipped = torch.zeros(loader_workers + 1, dtype=torch.int64).share_memory_()
        if hasattr(dataset, '_max_retries'):
            dataset._max_retries = 1  # report each bad image here, with its file name, instead of inside timm

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if index == PAD_INDEX:
            image, _ = self._first_readable(0, counted=False)
            return image, -1
        image, target = self._first_readable(index)
        return image, target

    def skipped_images(self) -> int:
        """Unreadable images skipped so far (by this process and its loader workers)."""
        return int(self.skipped.sum())

    def _first_readable(self, index: int, counted: bool = True) -> tuple[Any, int]:
        attempts, last_error = min(_MAX_CONSECUTIVE_BAD_IMAGES, len(self.dataset)), ''
        for attempt in range(attempts):
            candidate = (index + attempt) % len(self.dataset)
            try:
                if self.augment_seed is None:
                    image, target = self.dataset[candidate][:2]
                else:
                    with seeded_randomness(*self.augment_seed, candidate):
                        image, target = self.dataset[candidate][:2]
            except Exception as error:  # any decode / IO / transform failure of one file must not end the run
                _logger.warning('skipping unreadable image %s (index %d): %s', self._describe(candidate),
                                candidate, error)
                if counted and not attempt:  # each image once, when it is asked for (not as a stand-in)
                    worker = get_worker_info()
                    self.skipped[(0 if worker is None else worker.id + 1) % len(self.skipped)] += 1
                last_error = f'{self._describe(candidate)}: {error}'
                continue
            if attempt and not self.is_training:
                target = -1
            return image, target
        if attempts == len(self.dataset):
            raise DatasetError(f'{self.where}: none of its {attempts} images can be read (the last: {last_error}); '
                               f'check the files, or point the split at images')
        raise DatasetError(f'{self.where}: {attempts} consecutive images from index {index} cannot be read (the last: '
                           f'{last_error}); check the dataset files (a truncated copy?) or remove the broken ones')

    def _describe(self, index: int) -> str:
        try:
            return repr(self.dataset.filename(index))
        except Exception:
            return '(file name unknown)'


def skipped_images(dataset: Any) -> int:
    """Unreadable images a :class:`RobustDataset` has skipped so far (0 for any other dataset: a stream's reader
    skips them itself)."""
    return dataset.skipped_images() if isinstance(dataset, RobustDataset) else 0


def class_map_of(dataset: Dataset) -> dict[str, int] | None:
    """The class name -> index map of an image-folder (or tar) dataset or a torchvision dataset, else None."""
    dataset = getattr(dataset, 'dataset', dataset)  # through RobustDataset
    reader = getattr(dataset, 'reader', None)
    if reader is None:  # torchvision
        class_to_idx = getattr(dataset, 'class_to_idx', None)
    else:
        class_to_idx = getattr(reader, 'class_to_idx', None) or getattr(reader, 'class_name_to_idx', None)
    return dict(class_to_idx) if class_to_idx else None


def num_classes_of(dataset: Dataset) -> int | None:
    """The number of classes a dataset knows about (the largest index + 1), or None when it cannot tell."""
    class_to_idx = class_map_of(dataset)
    if class_to_idx:
        return max(class_to_idx.values()) + 1
    classes = getattr(getattr(dataset, 'dataset', dataset), 'classes', None)
    return len(classes) if classes else None


def class_names_of(dataset: Dataset) -> list[str] | None:
    """Class names in index order when the dataset has them (saved with checkpoints and in the export)."""
    class_to_idx = class_map_of(dataset)
    if class_to_idx:
        names = [''] * (max(class_to_idx.values()) + 1)
        for name, index in class_to_idx.items():
            names[index] = name
        return names
    classes = getattr(getattr(dataset, 'dataset', dataset), 'classes', None)
    return [str(c) for c in classes] if classes else None


def prepare_dataset(name: str, root: str | None, download: bool, debian_dir: str = DEBIAN_FASHION_MNIST) -> None:
    """Make a torchvision dataset readable offline when a local copy exists.

    torchvision's ``FashionMNIST(root)`` reads the four uncompressed IDX files from ``<root>/FashionMNIST/raw``; the
    Debian package ``dataset-fashion-mnist`` ships them gzipped in :data:`DEBIAN_FASHION_MNIST`, from where they are
    unpacked into the root.

    Args:
        name: The config's ``data.dataset``; only ``torch/fashion_mnist`` needs preparing.
        root: The dataset root (``data.data_dir``).
        download: Whether torchvision may download what is missing.
        debian_dir: Where the Debian package keeps its gzipped IDX files.

    Raises:
        DatasetNotFoundError: Fashion-MNIST is neither in the root nor in the Debian package and ``download`` is off.
    """
    if name.lower() != 'torch/fashion_mnist':
        return
    if root is None:
        raise DatasetNotFoundError('data.data_dir is not set; give the folder Fashion-MNIST lives in (or should be '
                                   'unpacked / downloaded to) with --data-dir or data.data_dir=PATH')
    raw_dir = os.path.join(root, 'FashionMNIST', 'raw')
    missing = [f for f in FASHION_MNIST_FILES if not os.path.isfile(os.path.join(raw_dir, f))]
    if not missing:
        return
    packaged = [os.path.join(debian_dir, f + '.gz') for f in missing]
    if all(os.path.isfile(p) for p in packaged):
        os.makedirs(raw_dir, exist_ok=True)
        for name_, source in zip(missing, packaged, strict=True):
            _gunzip_atomically(source, os.path.join(raw_dir, name_))
        return
    if download:
        return
    raise DatasetNotFoundError(
        f'Fashion-MNIST is not in {raw_dir} (missing {", ".join(missing)}). Install the Debian package '
        f'(apt-get install dataset-fashion-mnist, files in {debian_dir}), or set data.download=true to let '
        f'torchvision download it, or put the four IDX files there yourself.')


def _gunzip_atomically(source: str, target: str) -> None:
    with gzip.open(source, 'rb') as src, atomic_open(target, 'wb') as dst:
        shutil.copyfileobj(src, dst)


def create_split(config: Config, spec: InputSpec, is_training: bool,
                 class_map: Mapping[str, int] | None = None) -> Dataset:
    """A timm dataset for the training or validation split with its transform attached.

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
    if data.data_dir is None and not data.dataset.lower().startswith(('hfds/', 'hfids/')):
        raise DatasetNotFoundError('data.data_dir is not set: give the dataset folder with --data-dir PATH (or '
                                   'data.data_dir=PATH)')
    key = 'train_split' if is_training else 'val_split'
    if data.dataset.lower().startswith('torch/'):
        check_torchvision_split(data.dataset, getattr(data, key), key)
    prepare_dataset(data.dataset, data.data_dir, data.download)  # may unpack a local copy into data_dir first
    if data.data_dir is not None and not os.path.exists(data.data_dir) and not data.download:
        raise DatasetNotFoundError(f'data.data_dir {data.data_dir!r} does not exist')
    if _is_image_folder(data.dataset):
        dataset = _open_folder_split(config, key, is_training, class_map)
    else:
        dataset = _open_split(config, key, is_training, data.data_dir, class_map=data.class_map or '')
    transform = create_train_transform(config, spec) if is_training else create_eval_transform(spec)
    if data.dataset.lower().startswith('torch/'):
        transform = _compose(ImageMode(_image_mode(config)), transform)
    dataset.transform = transform
    if isinstance(dataset, IterableDataset):
        dataset.set_loader_cfg(num_workers=data.num_workers)
        return dataset
    where = f'data.{key} {getattr(data, key)!r} under {data.data_dir!r}'
    if len(dataset) == 0:
        raise DatasetNotFoundError(f'{where} holds no images')
    return RobustDataset(dataset, is_training=is_training, where=where, loader_workers=data.num_workers)


def _image_mode(config: Config) -> str:
    return 'L' if config.model.in_chans == 1 else 'RGB'


def _is_image_folder(dataset: str) -> bool:
    """timm reads a name without a ``prefix/`` as a folder (or tar) of class folders; torchvision's ImageFolder too."""
    return '/' not in dataset or dataset.lower() in ('torch/image_folder', 'torch/folder')


def _open_split(config: Config, key: str, is_training: bool, root: str | None,
                class_map: Mapping[str, int] | str = '') -> Dataset:
    """``create_dataset`` for one split, its failures reported as a :class:`DatasetNotFoundError`."""
    data, split = config.data, getattr(config.data, key)
    num_samples = data.train_num_samples if is_training else data.val_num_samples
    try:
        return create_dataset(
            data.dataset, root=root, split=split, search_split=False, is_training=is_training, class_map=class_map,
            download=data.download, batch_size=config.train.batch_size, num_samples=num_samples,
            seed=config.train.seed, input_img_mode=_image_mode(config))
    except (FileNotFoundError, RuntimeError, AssertionError, KeyError, ValueError) as e:
        raise DatasetNotFoundError(f'data.{key}: cannot open the {split!r} split of dataset '
                                   f'{data.dataset or "(image folder)"!r} under {data.data_dir!r}: '
                                   f'{e or type(e).__name__}') from e


def _open_folder_split(config: Config, key: str, is_training: bool, class_map: Mapping[str, int] | None) -> Dataset:
    """An image-folder split, labelled with the run's one class map (see :mod:`.splits`)."""
    data = config.data
    root = split_folder(data.data_dir, getattr(data, key), f'data.{key}')
    loose = loose_images(root)
    if loose:
        raise DatasetError(
            f'data.{key}: {root!r} holds {len(loose)} image(s) outside any class folder ({listing(loose, 3)}); an '
            f'image-folder split is <split>/<class>/<image>, its classes being its sub-folders. Move each image into '
            f'the folder of its class')
    dataset = _open_split(config, key, is_training, root)
    found = class_map_of(dataset) or {}
    reference, source = class_map, 'the training split\'s classes'
    if data.class_map:
        reference, source = load_class_map(data.class_map, data.data_dir), 'the classes of data.class_map'
    if reference is None:  # the training split decides the classes
        empty = class_folders_without_images(root, found)
        if empty:
            raise DatasetError(
                f'data.{key}: class folder(s) {", ".join(sorted(empty))} under {root!r} hold no images; a class the '
                f'model never sees cannot be learned, and leaving it out would renumber the classes after it. Add '
                f'its images, or remove the folder from every split')
        return dataset
    check_split_classes(found, reference, f'data.{key}: {root!r}', source)
    if any(reference[name] != index for name, index in found.items()):
        if not hasattr(dataset, 'reader'):
            raise DatasetError(f'data.{key}: {root!r} lacks some classes of {source}, and torchvision\'s ImageFolder '
                               f'(data.dataset={data.dataset!r}) would number the rest differently; use '
                               f'data.dataset=\'\' (timm\'s folder reader), which labels it with the classes of '
                               f'{source}')
        dataset = _open_split(config, key, is_training, root, class_map=dict(reference))
    return dataset


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


def _compose(first: Any, rest: Any) -> Any:
    return transforms.Compose([first, *getattr(rest, 'transforms', [rest])])


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
