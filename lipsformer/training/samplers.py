"""Samplers that shard a dataset over processes reproducibly and can start part-way through an epoch.

The training order depends only on (seed, epoch), never on global RNG state, so a resumed run visits the same
images in the same order, and resuming mid-epoch yields exactly the images this process had not yet seen.
"""
from collections.abc import Iterator

import torch
from torch.utils.data import Sampler

# Index the evaluation sampler yields for padding; the dataset wrapper answers it with a sample labelled -1.
PAD_INDEX = -1


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
