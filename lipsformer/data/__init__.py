"""The data readers that training, evaluation and the stability sweep share.

- :mod:`.splits`: which images a split name means (``<data_dir>/<split>`` or one of timm's synonyms, a torchvision
  dataset's training or test set) and one class map for every split, with :class:`DatasetError` /
  :class:`DatasetNotFoundError` naming what was looked for and what exists;
- :mod:`.datasets`: :class:`RobustDataset` (an unreadable image is counted and skipped, never the end of a run), the
  class maps a dataset carries, and per-image randomness seeded by a key;
- :mod:`.sources`: :func:`open_split`, one split of a :class:`DataSource` (timm's dataset name and root) opened as
  timm opens it, checked, with its transform, as a :class:`RobustDataset`;
- :mod:`.images`: the one image reader (:func:`read_image`, :class:`ImageMode`): 16-bit images scaled to the
  8-bit range, not clipped; images of an unknown range refused with the file named;
- :mod:`.fashion_mnist`: the one reader of Fashion-MNIST's IDX files, and the offline copy torchvision reads.

``lipsformer.training.data`` opens a run's splits here from its config (and adds the samplers and batches); the
ImageNet val / V2 layouts that validate.py scores are ``lipsformer.evaluation.layouts``.
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
from .images import UnreadableImageError, read_image
from .sources import DataSource, decode_here, open_split
from .splits import DatasetError, DatasetNotFoundError, check_split_classes, check_torchvision_split, split_folder

__all__ = ['DEBIAN_FASHION_MNIST', 'PAD_INDEX', 'DataSource', 'DatasetError', 'DatasetNotFoundError', 'ImageMode',
           'RobustDataset', 'UnreadableImageError', 'check_split_classes', 'check_torchvision_split', 'class_map_of',
           'class_names_of', 'decode_here', 'num_classes_of', 'open_split', 'prepare_dataset', 'read_fashion_mnist',
           'read_idx', 'read_image', 'seeded_randomness', 'skipped_images', 'split_folder']
