"""Fashion-MNIST subsets as in-memory tensors, padded to 32x32, and the batches of one run.

Every run of the grid sees the same class-balanced train and test subsets (chosen by a fixed seed); a run's seed only
sets its batch order and flips. Batches are a function of (seed, step), so a resumed run draws exactly the batches
it would have drawn without the interruption.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torchvision.datasets import FashionMNIST

from ...training.data import prepare_dataset

__all__ = ['Batches', 'Subsets', 'load_subsets', 'synthetic_subsets']

FASHION_MNIST_MEAN, FASHION_MNIST_STD = 0.2860, 0.3530
NUM_CLASSES = 10
SUBSET_SEED = 0


@dataclass
class Subsets:
    """Normalised (N, 1, 32, 32) images and (N,) labels of the train and test subsets."""
    train_images: torch.Tensor
    train_labels: torch.Tensor
    test_images: torch.Tensor
    test_labels: torch.Tensor

    def to(self, device: torch.device) -> 'Subsets':
        return Subsets(*(t.to(device) for t in (self.train_images, self.train_labels, self.test_images,
                                                 self.test_labels)))


def balanced_indices(labels: torch.Tensor, size: int, seed: int = SUBSET_SEED) -> torch.Tensor:
    """``size`` indices with ``size // 10`` per class, drawn by ``seed``, in a class-interleaved order."""
    if size % NUM_CLASSES:
        raise ValueError(f'subset size must be a multiple of {NUM_CLASSES}, got {size}')
    generator = torch.Generator().manual_seed(seed)
    per_class = [torch.nonzero(labels == c).flatten() for c in range(NUM_CLASSES)]
    chosen = [idx[torch.randperm(len(idx), generator=generator)[:size // NUM_CLASSES]] for idx in per_class]
    return torch.stack(chosen, dim=1).flatten()


def _to_inputs(images: torch.Tensor) -> torch.Tensor:
    """(N, 28, 28) uint8 -> normalised (N, 1, 32, 32) float, zero (background) padding of 2 pixels."""
    padded = F.pad(images.float().div(255.0), (2, 2, 2, 2))
    return padded.sub(FASHION_MNIST_MEAN).div(FASHION_MNIST_STD).unsqueeze(1)


def load_subsets(root: str, train_size: int, test_size: int) -> Subsets:
    """Class-balanced subsets of real Fashion-MNIST (unpacked from the Debian package into ``root`` if needed)."""
    prepare_dataset('torch/fashion_mnist', root, download=False)
    train, test = FashionMNIST(root, train=True), FashionMNIST(root, train=False)
    train_idx = balanced_indices(train.targets, train_size)
    test_idx = balanced_indices(test.targets, test_size)
    return Subsets(_to_inputs(train.data[train_idx]), train.targets[train_idx],
                   _to_inputs(test.data[test_idx]), test.targets[test_idx])


def synthetic_subsets(train_size: int, test_size: int) -> Subsets:
    """Random images whose class shifts their mean: a stand-in for tests on machines without Fashion-MNIST."""
    generator = torch.Generator().manual_seed(SUBSET_SEED)

    def draw(size: int) -> tuple[torch.Tensor, torch.Tensor]:
        labels = torch.arange(size) % NUM_CLASSES
        images = torch.randn(size, 1, 32, 32, generator=generator) + labels.float().view(-1, 1, 1, 1) / NUM_CLASSES
        return images, labels

    return Subsets(*draw(train_size), *draw(test_size))


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
