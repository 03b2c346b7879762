"""The data readers that training, evaluation and the experiments share.

- :mod:`.splits`: which images a split name means (``<data_dir>/<split>`` or one of timm's synonyms, a torchvision
  dataset's training or test set) and one class map for every split, with :class:`DatasetError` /
  :class:`DatasetNotFoundError` naming what was looked for and what exists;
- :mod:`.datasets`: :class:`RobustDataset` (an unreadable image is counted and skipped, never the end of a run), the
  class maps a dataset carries, and per-image randomness seeded by a key;
- :mod:`.fashion_mnist`: the one reader of Fashion-MNIST's IDX files, and the offline copy torchvision reads.

How a training run opens its splits from its config is ``lipsformer.training.data``; the ImageNet val / V2 layouts
that validate.py scores are ``lipsformer.evaluation.layouts``.
"""
from .datasets import (
           PAD_INDEX,
           ImageMode,
           RobustDataset,
           class_map_of,
           class_names_of,
           num_classes_of,
           seeded_randomness,
           skipped_images,
)
from .fashion_mnist import DEBIAN_FASHION_MNIST, prepare_dataset, read_fashion_mnist, read_idx
from .splits import DatasetError, DatasetNotFoundError, check_split_classes, check_torchvision_split, split_folder

__all__ = ['DEBIAN_FASHION_MNIST', 'PAD_INDEX', 'DatasetError', 'DatasetNotFoundError', 'ImageMode', 'RobustDataset',
           'check_split_classes', 'check_torchvision_split', 'class_map_of', 'class_names_of', 'num_classes_of',
           'prepare_dataset', 'read_fashion_mnist', 'read_idx', 'seeded_randomness', 'skipped_images',
           'split_folder']
