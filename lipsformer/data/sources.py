"""One split of a data set opened as timm opens it, with the checks timm leaves out, wrapped so that bad images never
end a run.

A :class:`DataSource` is what every split of a run shares (timm's dataset name, its root, how to read images);
:func:`open_split` opens one split of it: the split's folder is found as :mod:`.splits` says (no silent fall-back to
the root), an image-folder split is labelled with the one class map of the run, Fashion-MNIST is unpacked from the
Debian package when it is installed, the transform is attached, and a map-style split comes back as a
:class:`~.datasets.RobustDataset`. Training (``lipsformer.training.data.create_split``, from a run's config) and the
stability experiment open their splits here.
"""
import contextlib
import logging
import os
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
from timm.data import ImageDataset, create_dataset
from timm.data.readers.class_map import load_class_map
from timm.data.readers.img_extensions import get_img_extensions, set_img_extensions
from timm.data.readers.reader_image_in_tar import ReaderImageInTar
from timm.utils.misc import natural_key
from torch.utils.data import Dataset, IterableDataset
from torchvision import transforms
from torchvision.datasets import DatasetFolder
from torchvision.datasets.folder import default_loader

from .datasets import RobustDataset, class_map_of
from .fashion_mnist import prepare_dataset
from .images import IMAGE_EXTENSIONS, ImageMode
from .splits import (
    DatasetError,
    DatasetNotFoundError,
    check_split_classes,
    check_torchvision_split,
    class_folders_without_images,
    leads_outside,
    listing,
    loose_images,
    non_image_files,
    split_folder,
    tar_members_outside,
)

__all__ = ['DataSource', 'decode_here', 'every_image_type', 'is_image_folder', 'open_split']

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataSource:
    """The data set the splits of a run are read from, as timm's ``create_dataset`` takes it (train.py's ``data.*``).

    Attributes:
        dataset: timm's dataset name: ``''`` (or a name without ``prefix/``) for a folder or tar of class folders,
            ``torch/<name>``, ``hfds/<repo>``, ``wds/<name>``, ...
        data_dir: The data set root (None only for Hugging Face data sets).
        download: Let torchvision / Hugging Face download what is missing.
        class_map: A file of class names (relative to ``data_dir``) that numbers the classes; ``''``: the training
            split's class folders do.
        in_chans: 1 reads images as grayscale (``L``), else RGB.
        batch_size: Batch size, for the streaming readers that shard by it.
        seed: Seed of the streaming readers' shuffling.
        num_workers: Loader worker processes that will read the splits.
    """
    dataset: str = ''
    data_dir: str | None = None
    download: bool = False
    class_map: str = ''
    in_chans: int = 3
    batch_size: int = 1
    seed: int = 0
    num_workers: int = 0

    @property
    def image_mode(self) -> str:
        return 'L' if self.in_chans == 1 else 'RGB'


def decode_here(dataset: Dataset) -> bool:
    """Make timm's map-style ``ImageDataset`` (folders, tars, Hugging Face data sets) and torchvision's ``ImageFolder``
    hand over each file's bytes, for the package's reader (:class:`~.images.ImageMode`) to decode: high-bit-depth
    images are scaled, not clipped (torchvision's own loader converts a 16-bit image to RGB by clipping), and a
    decoding error reaches :class:`~.datasets.RobustDataset`'s log with its reason. Returns whether it did."""
    if isinstance(dataset, ImageDataset):
        dataset.load_bytes, dataset.input_img_mode = True, None
        return True
    if isinstance(dataset, DatasetFolder) and dataset.loader is default_loader:  # a loader of the user's stays
        dataset.loader = _file_bytes
        return True
    return False


def _file_bytes(path: str) -> bytes:
    """A file's bytes, read whole (a module's function, so that spawned loader workers can unpickle it)."""
    with open(path, 'rb') as f:
        return f.read()


def is_image_folder(dataset: str) -> bool:
    """timm reads a name without a ``prefix/`` as a folder (or tar) of class folders; torchvision's ImageFolder too."""
    return '/' not in dataset or dataset.lower() in ('torch/image_folder', 'torch/folder')


@contextlib.contextmanager
def every_image_type() -> Iterator[None]:
    """Inside, timm's readers of class folders and of ``.tar`` files list every type the package's reader decodes
    (:data:`~.images.IMAGE_EXTENSIONS`, TIFF among them), not timm's JPEG and PNG alone. The tar reader takes no list
    of types of its own; both look timm's list up only while they list the files, which is when a data set is
    opened (``create_dataset``), so it is timm's again afterwards."""
    saved = get_img_extensions()
    set_img_extensions(sorted(IMAGE_EXTENSIONS))
    try:
        yield
    finally:
        set_img_extensions(saved)


def open_split(source: DataSource, split: str, option: str, is_training: bool, transform: Callable[[Any], Any],
               class_map: Mapping[str, int] | None = None, num_samples: int | None = None) -> Dataset:
    """One split of ``source`` with ``transform`` attached.

    Args:
        source: The data set.
        split: The split's name (or a synonym timm accepts: ``val`` for ``validation``, ...).
        option: The config key or option that names the split, for messages (``data.train_split``).
        is_training: A training split (an unreadable image's stand-in keeps its label) or an evaluation one.
        transform: The transform of each image.
        class_map: The training split's class map, with which an image-folder evaluation split is labelled.
        num_samples: Samples of a streamed split (its length), where the reader needs it.

    Returns:
        A :class:`~.datasets.RobustDataset` of a map-style split; a streamed split as timm's reader gives it.

    Raises:
        DatasetNotFoundError: The data set or the split is not there, or holds no images.
        DatasetError: The split's classes do not fit ``class_map`` (or ``source.class_map``).
    """
    name = source.dataset
    if source.data_dir is None and not name.lower().startswith(('hfds/', 'hfids/')):
        raise DatasetNotFoundError('data.data_dir is not set: give the dataset folder with --data-dir PATH (or '
                                   'data.data_dir=PATH)')
    if name.lower().startswith('torch/'):
        check_torchvision_split(name, split, option)
    prepare_dataset(name, source.data_dir, source.download)  # may unpack a local copy into data_dir first
    if source.data_dir is not None and not os.path.exists(source.data_dir) and not source.download:
        raise DatasetNotFoundError(f'data.data_dir {source.data_dir!r} does not exist')
    if is_image_folder(name):
        dataset = _open_folder_split(source, split, option, is_training, class_map, num_samples)
    else:
        dataset = _create(source, split, option, is_training, source.data_dir, source.class_map, num_samples)
    if decode_here(dataset) or name.lower().startswith('torch/'):
        transform = transforms.Compose([ImageMode(source.image_mode), *getattr(transform, 'transforms', [transform])])
    dataset.transform = transform
    if isinstance(dataset, IterableDataset):
        dataset.set_loader_cfg(num_workers=source.num_workers)
        return dataset
    where = f'{option} {split!r} under {source.data_dir!r}'
    if len(dataset) == 0:
        raise DatasetNotFoundError(f'{where} holds no images')
    return RobustDataset(dataset, is_training=is_training, where=where, loader_workers=source.num_workers)


def _create(source: DataSource, split: str, option: str, is_training: bool, root: str | None,
            class_map: Mapping[str, int] | str, num_samples: int | None) -> Dataset:
    """``create_dataset`` for one split, its failures reported as a :class:`DatasetNotFoundError`."""
    try:
        with every_image_type():
            dataset = create_dataset(
                source.dataset, root=root, split=split, search_split=False, is_training=is_training,
                class_map=class_map, download=source.download, batch_size=source.batch_size, num_samples=num_samples,
                seed=source.seed, input_img_mode=source.image_mode)
    except (FileNotFoundError, RuntimeError, AssertionError, KeyError, ValueError) as e:
        raise DatasetNotFoundError(f'{option}: cannot open the {split!r} split of dataset '
                                   f'{source.dataset or "(image folder)"!r} under {source.data_dir!r}: '
                                   f'{e or type(e).__name__}') from e
    _drop_members_outside(dataset, renumber=not class_map)
    return dataset


def _drop_members_outside(dataset: Dataset, renumber: bool) -> None:
    """Take the members of a tar split whose paths lead out of the archive (``../x/a.png``, ``/x/a.png``) out of
    timm's tar reader, which labels each by the folder above it: none is read, and none is a class.

    Args:
        dataset: What ``create_dataset`` made; anything but a tar split is left as it is.
        renumber: The classes were the members' folders (no class map given): number the ones left anew, in timm's
            natural order, so that a class only such members had is gone. With a class map the indices stay.
    """
    reader = getattr(dataset, 'reader', None)
    if not isinstance(reader, ReaderImageInTar) or not len(reader.samples):
        return
    keep = [index for index, (member, _, inner_tar) in enumerate(reader.samples)
            if not leads_outside(member.name) and not (inner_tar is not None and leads_outside(inner_tar.name))]
    if len(keep) == len(reader.samples):
        return
    samples, targets = reader.samples[keep], reader.targets[keep]
    if renumber:
        names = [reader.class_idx_to_name[int(target)] for target in targets]
        reader.class_name_to_idx = {name: index for index, name in enumerate(sorted(set(names), key=natural_key))}
        reader.class_idx_to_name = {index: name for name, index in reader.class_name_to_idx.items()}
        targets = np.array([reader.class_name_to_idx[name] for name in names], dtype=targets.dtype)
    reader.samples, reader.targets = samples, targets


def _open_folder_split(source: DataSource, split: str, option: str, is_training: bool,
                       class_map: Mapping[str, int] | None, num_samples: int | None) -> Dataset:
    """An image-folder split, labelled with the run's one class map (see :mod:`.splits`)."""
    root = split_folder(source.data_dir, split, option)
    loose = loose_images(root)
    if loose:
        raise DatasetError(
            f'{option}: {root!r} holds {len(loose)} image(s) outside any class folder ({listing(loose, 3)}); an '
            f'image-folder split is <split>/<class>/<image>, its classes being its sub-folders. Move each image into '
            f'the folder of its class')
    left_out = non_image_files(root)
    if left_out:
        _logger.warning('%s: skipping %d file(s) under %r that are not images (read: %s): %s', option, len(left_out),
                        root, ' '.join(sorted(IMAGE_EXTENSIONS)), listing(left_out, 5))
    outside = tar_members_outside(root)
    if outside:
        _logger.warning('%s: skipping %d member(s) of %r whose paths lead out of the archive (absolute, or with ..): '
                        '%s; they are not read and make no class. Store every image as <class>/<image> inside it',
                        option, len(outside), root, listing(outside, 5))
    dataset = _create(source, split, option, is_training, root, '', num_samples)
    found = class_map_of(dataset) or {}
    reference, described = class_map, 'the training split\'s classes'
    if source.class_map:
        reference, described = load_class_map(source.class_map, source.data_dir), 'the classes of data.class_map'
    if reference is None:  # the training split decides the classes
        empty = class_folders_without_images(root, found)
        if empty:
            raise DatasetError(
                f'{option}: class folder(s) {", ".join(sorted(empty))} under {root!r} hold no images; a class the '
                f'model never sees cannot be learned, and leaving it out would renumber the classes after it. Add '
                f'its images, or remove the folder from every split')
        return dataset
    check_split_classes(found, reference, f'{option}: {root!r}', described)
    if any(reference[name] != index for name, index in found.items()):
        if not hasattr(dataset, 'reader'):
            raise DatasetError(f'{option}: {root!r} lacks some classes of {described}, and torchvision\'s ImageFolder '
                               f'(data.dataset={source.dataset!r}) would number the rest differently; use '
                               f'data.dataset=\'\' (timm\'s folder reader), which labels it with the classes of '
                               f'{described}')
        dataset = _create(source, split, option, is_training, root, dict(reference), num_samples)
    return dataset
