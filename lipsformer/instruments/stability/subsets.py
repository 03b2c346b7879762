"""The train and test subsets as in-memory tensors, and the batches of one run.

Two sources: Fashion-MNIST (padded from 28x28 to 32x32, one channel, ten classes) and any image folder with ``train``
and ``val`` splits of class folders (each image resized, shorter side first, and centre-cropped to the model's input;
one channel when every chosen image is grayscale, else three; as many classes as the training split has folders).

Every run of the grid sees the same class-balanced train and test subsets (chosen by a fixed seed); a run's seed only
sets its batch order and flips. Batches are a function of (seed, step), so a resumed run draws exactly the batches
it would have drawn without the interruption.
"""
import logging
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from PIL import Image
from timm.data import create_transform

from ...data import DataSource, class_map_of, open_split, prepare_dataset, read_fashion_mnist

__all__ = ['Batches', 'Subsets', 'balanced_indices', 'load_image_folder', 'load_subsets', 'synthetic_subsets']

_logger = logging.getLogger(__name__)

FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
FASHION_MNIST_CLASSES = 10
SUBSET_SEED = 0
# PIL modes of one band: a folder whose chosen images are all of these is read as one channel.
_GRAYSCALE_MODES = ('1', 'L', 'LA', 'I', 'I;16', 'F')


@dataclass
class Subsets:
    """Normalised (N, C, S, S) images and (N,) labels of the train and test subsets, and the number of classes."""
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor
    num_classes: int = FASHION_MNIST_CLASSES

    @property
    def in_chans(self) -> int:
        return self.train_images.shape[1]

    @property
    def img_size(self) -> int:
        return self.train_images.shape[-1]

    def to(self, device: torch.device) -> 'Subsets':
        return Subsets(*(t.to(device) for t in (self.train_images, self.train_labels, self.test_images,
                                                 self.test_labels)), num_classes=self.num_classes)


def balanced_indices(labels: torch.Tensor, size: int, num_classes: int = FASHION_MNIST_CLASSES,
                     seed: int = SUBSET_SEED, option: str = 'size') -> torch.Tensor:
    """``size // num_classes`` indices per class, drawn by ``seed``, in a class-interleaved order.

    Raises:
        ValueError: ``size`` is less than one image per class, or a class has fewer images than its share (``option``
            names the command-line option that sets ``size``, for the message).
    """
    share = size // num_classes
    if share == 0:
        raise ValueError(f'{option} {size} is less than one image for each of the {num_classes} classes')
    if share * num_classes != size:
        _logger.warning('%s %d is not a multiple of the %d classes: using %d images (%d per class)', option, size,
                        num_classes, share * num_classes, share)
    generator = torch.Generator().manual_seed(seed)
    per_class = [torch.nonzero(labels == c).flatten() for c in range(num_classes)]
    short = {c: len(idx) for c, idx in enumerate(per_class) if len(idx) < share}
    if short:
        fewest = min(short.values())
        raise ValueError(f'{option} {size} needs {share} images of each class; class(es) {sorted(short)} have only '
                         f'{fewest}: use {option} {fewest * num_classes} or less')
    chosen = [idx[torch.randperm(len(idx), generator=generator)[:share]] for idx in per_class]
    return torch.stack(chosen, dim=1).flatten()


def _to_inputs(images: torch.Tensor) -> torch.Tensor:
    """(N, 28, 28) uint8 -> normalised (N, 1, 32, 32) float, zero (background) padding of 2 pixels."""
    padded = F.pad(images.float().div(255.0), (2, 2, 2, 2))
    return padded.sub(FASHION_MNIST_MEAN).div(FASHION_MNIST_STD).unsqueeze(1)


def load_subsets(root: str, train_size: int, test_size: int) -> Subsets:
    """Class-balanced subsets of real Fashion-MNIST (unpacked from the Debian package into ``root`` if needed)."""
    prepare_dataset('torch/fashion_mnist', root, download=False)
    raw = os.path.join(root, 'FashionMNIST', 'raw')  # where torchvision keeps them, and prepare_dataset puts them
    (train_images, train_labels), (test_images, test_labels) = (read_fashion_mnist(s, raw) for s in ('train', 'test'))
    train_idx = balanced_indices(train_labels, train_size, option='--train-size')
    test_idx = balanced_indices(test_labels, test_size, option='--test-size')
    return Subsets(_to_inputs(train_images[train_idx]), train_labels[train_idx],
                   _to_inputs(test_images[test_idx]), test_labels[test_idx])


def _folder_split(root: str, img_size: int, in_chans: int, is_training: bool,
                  class_map: dict[str, int] | None = None):
    """One split of an image folder through the package's reader (split synonyms, one class map for both splits,
    unreadable images skipped), each image resized (shorter side) and centre-cropped to ``img_size``, as uint8."""
    # No random crops: the subsets are fixed tensors. uint8 out (the prefetcher's transform), normalised later.
    transform = create_transform((in_chans, img_size, img_size), is_training=False, interpolation='bicubic',
                                 mean=(0.0,) * in_chans, std=(1.0,) * in_chans, crop_pct=1.0, crop_mode='center',
                                 use_prefetcher=True)
    split, option = ('train', 'the training split') if is_training else ('validation', 'the validation split')
    dataset = open_split(DataSource(data_dir=root, in_chans=in_chans), split, option, is_training, transform,
                         class_map=class_map)
    dataset.is_training = False  # an unreadable image's stand-in is labelled -1 and left out, not counted twice
    return dataset


def _split_labels(dataset) -> torch.Tensor:
    return torch.tensor([target for _, target in dataset.dataset.reader.samples])


def _is_grayscale(path: str) -> bool:
    """Whether the image has one band (an unreadable file does not count: the reader leaves it out)."""
    try:
        with Image.open(path) as image:  # reads the header only
            return image.mode in _GRAYSCALE_MODES
    except (OSError, ValueError):
        return True


def _stack(dataset, indices: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The chosen images (uint8) and labels; an image that cannot be read is left out (the reader logs it)."""
    images, labels = [], []
    for index in indices.tolist():
        image, label = dataset[index]
        if label >= 0:
            images.append(image)
            labels.append(label)
    return torch.stack(images), torch.tensor(labels)


def load_image_folder(root: str, img_size: int, train_size: int, test_size: int) -> Subsets:
    """Class-balanced subsets of an image folder: ``root/train/<class>/*`` and ``root/val/<class>/*`` (or the
    synonyms :func:`~lipsformer.data.splits.split_folder` accepts), normalised by the training subset's
    per-channel mean and std.

    Raises:
        DatasetError: A split is missing, or the validation split has a class the training split lacks.
        ValueError: A class has fewer images than its share of ``train_size`` or ``test_size``.
    """
    train = _folder_split(root, img_size, 3, is_training=True)
    class_map = class_map_of(train)
    num_classes = max(class_map.values()) + 1
    train_idx = balanced_indices(_split_labels(train), train_size, num_classes, option='--train-size')
    test = _folder_split(root, img_size, 3, is_training=False, class_map=class_map)
    test_idx = balanced_indices(_split_labels(test), test_size, num_classes, option='--test-size')
    chosen = [train.dataset.filename(i, absolute=True) for i in train_idx.tolist()]
    chosen += [test.dataset.filename(i, absolute=True) for i in test_idx.tolist()]
    if all(_is_grayscale(path) for path in chosen):
        train = _folder_split(root, img_size, 1, is_training=True)
        test = _folder_split(root, img_size, 1, is_training=False, class_map=class_map)
    train_images, train_labels = _stack(train, train_idx)
    test_images, test_labels = _stack(test, test_idx)
    pixels = train_images.float().div(255.0)
    mean = pixels.mean(dim=(0, 2, 3), keepdim=True)
    std = pixels.std(dim=(0, 2, 3), keepdim=True).clamp_min(1e-6)
    _logger.info('%s: %d classes, %d channel(s), %d train and %d test images at %dx%d', root, num_classes,
                 train_images.shape[1], len(train_labels), len(test_labels), img_size, img_size)
    return Subsets(pixels.sub(mean).div(std), train_labels, test_images.float().div(255.0).sub(mean).div(std),
                   test_labels, num_classes=num_classes)


def synthetic_subsets(train_size: int, test_size: int, num_classes: int = FASHION_MNIST_CLASSES) -> Subsets:
    """Random images whose class shifts their mean: a stand-in for tests on machines without Fashion-MNIST."""
    generator = torch.Generator().manual_seed(SUBSET_SEED)

    def draw(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(size) % num_classes
        images = torch.randn(size, 1, 32, 32, generator=generator) + labels.float().view(-1, 1, 1, 1) / num_classes
        return images, labels

    return Subsets(*draw(train_size), *draw(test_size), num_classes=num_classes)


class Batches:
    """Batch ``step`` of a run: epochs are seeded permutations of the train subset, with random horizontal flips."""

    def __init__(self, subsets: Subsets, batch_size: int, seed: int) -> None:
        self.images, self.labels = subsets.train_images, subsets.train_labels
        self.batch_size = batch_size
        self.seed = seed
        self.steps_per_epoch = len(self.labels) // batch_size  # the last partial batch of an epoch is dropped
        if self.steps_per_epoch == 0:
            raise ValueError(f'batch size {batch_size} exceeds the train subset ({len(self.labels)} images)')

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The batch of 0-based optimizer step ``step``."""
        epoch, position = divmod(step, self.steps_per_epoch)
        order = torch.randperm(len(self.labels), generator=self._generator(epoch, 0))
        idx = order[position * self.batch_size:(position + 1) * self.batch_size].to(self.labels.device)
        images = self.images[idx]
        flip = torch.rand(len(idx), generator=self._generator(epoch, position + 1)) < 0.5
        images = torch.where(flip.to(images.device).view(-1, 1, 1, 1), images.flip(-1), images)
        return images, self.labels[idx]

    def _generator(self, epoch: int, stream: int) -> torch.Generator:
        # Distinct streams per (seed, epoch, batch) keep batches independent of how far a run got before resuming.
        return torch.Generator().manual_seed(hash((self.seed, epoch, stream)) & (2 ** 62 - 1))
