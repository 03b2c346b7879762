"""Map-style datasets that never end a run on a bad image, their class maps, and seeded per-image randomness.

- :class:`RobustDataset` wraps any map-style dataset (timm's readers, torchvision's): an unreadable image is logged
  with its file name, counted and replaced; the evaluation sampler's padding index gives a sample labelled -1.
- :func:`seeded_randomness`: the random transform of an image depends only on a key (seed, epoch, image), not on which
  loader worker runs it nor on what ran before.
- :func:`class_map_of` / :func:`num_classes_of` / :func:`class_names_of`: what a dataset says about its classes.
"""
import contextlib
import logging
import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .images import ImageMode
from .splits import DatasetError

__all__ = ['PAD_INDEX', 'ImageMode', 'RobustDataset', 'class_map_of', 'class_names_of', 'num_classes_of',
           'seeded_randomness', 'skipped_images']

_logger = logging.getLogger(__name__)

# How many following images to try in place of an unreadable one before giving up.
_MAX_CONSECUTIVE_BAD_IMAGES = 50

# Index the evaluation sampler yields for padding; the dataset wrapper answers it with a sample labelled -1.
PAD_INDEX = -1


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
            return repr(self.dataset.filename(index))  # timm's datasets
        except Exception:
            pass
        try:
            return repr(self.dataset.samples[index][0])  # torchvision's folder datasets: (path, class index)
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
