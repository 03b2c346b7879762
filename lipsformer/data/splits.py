"""Which images ``data.train_split`` and ``data.val_split`` mean, and one class map for both.

timm's ``create_dataset`` forgives mistakes silently: a split folder that is not there falls back to the dataset root
(so a missing ``validation/`` validates on the training images, and ``train_split: trian`` trains on every split),
a torchvision dataset takes any split name that is not ``train`` for its test set, and each class folder tree is
numbered on its own (so a validation split without one class scores every later class against the wrong label). Here:

- a split of an image-folder dataset is ``<data_dir>/<split>`` (a folder or a ``.tar``), else one of timm's synonyms
  of that name (``val`` for ``validation``, ...); anything else is an error naming what was looked for and what exists;
- the training split's classes are the class map of the run (or ``data.class_map`` when given): the validation split
  is scored with those indices; a validation class the training split lacks (an extra or renamed folder) is an error,
  a class missing from validation is fine; a training class folder without images is an error (validate.py checks
  class folders against a model's saved classes with the same :func:`check_split_classes`);
- a torchvision dataset's split must be one of the names that select its training or test set.
"""
import logging
import os
import tarfile
from collections.abc import Iterable, Mapping

from timm.utils.misc import natural_key

from .images import is_image_file

__all__ = ['DatasetError', 'DatasetNotFoundError', 'check_split_classes', 'check_torchvision_split',
           'class_folders_without_images', 'leads_outside', 'listing', 'loose_images', 'non_image_files',
           'split_folder', 'tar_members_outside']

_logger = logging.getLogger(__name__)

# timm's split synonyms (timm.data.dataset_factory): the names one split is found under.
TRAIN_NAMES = ('train', 'training')
EVAL_NAMES = ('validation', 'val', 'valid', 'eval', 'evaluation')
# torchvision datasets that have a training set and a test set, chosen by timm from the split name.
_TORCHVISION_TRAIN_TEST = ('cifar10', 'cifar100', 'mnist', 'kmnist', 'fashion_mnist', 'qmnist')


class DatasetError(Exception):
    """A dataset whose splits or classes cannot be used as given; the message says what is wrong and how to fix it."""


class DatasetNotFoundError(DatasetError, FileNotFoundError):
    """The dataset or one of its splits is not on disk and cannot be fetched; the message says how to get it."""


def listing(names: list[str], limit: int = 8) -> str:
    """Names in natural order, the first ``limit`` of them and how many in all; 'nothing' for none."""
    names = sorted(names, key=natural_key)
    return ', '.join(names[:limit]) + (f' ... ({len(names)} in all)' if len(names) > limit else '') or 'nothing'


def split_folder(root: str, split: str, key: str, root_key: str = 'data.data_dir') -> str:
    """The folder (or ``.tar`` file) holding ``split`` of an image-folder dataset under ``root``.

    Args:
        root: ``data.data_dir``.
        split: The split's name.
        key: The config key or option that named it (``data.train_split``, ``--split``), for the message.
        root_key: The config key or option that named ``root``, for the message.

    Raises:
        DatasetNotFoundError: Neither the split nor a synonym of it is under ``root``.
    """
    if not os.path.isdir(root):
        raise DatasetNotFoundError(f'{root_key} {root!r} is not a folder; an image-folder dataset is a folder with '
                                   f'one sub-folder per split ({key}: {split!r})')
    family = next((names for names in (TRAIN_NAMES, EVAL_NAMES) if split in names), ())
    tried = [split, *(name for name in family if name != split)]
    for name in tried:
        for candidate in (name, f'{name}.tar'):
            path = os.path.join(root, candidate)
            if os.path.exists(path):
                if name != split:
                    _logger.info('%s: %r is not under %s; using %r, a synonym timm accepts', key, split, root,
                                 candidate)
                return path
    present = [entry.name for entry in os.scandir(root) if not entry.name.startswith('.') and (
        entry.is_dir() or entry.name.endswith('.tar'))]
    hint = (f'; if {root!r} itself holds the class folders of one split, point {root_key} at the folder above it '
            f'and name the split' if present and not set(present) & set(TRAIN_NAMES + EVAL_NAMES) else '')
    images = loose_images(root)
    if images:
        holds = f'{len(images)} image(s) ({listing(images, 3)})' + (f' and {listing(present)}' if present else '')
        hint = (f'; an image-folder dataset is <data_dir>/<split>/<class>/<image>: put the images into class folders '
                f'inside a split folder ({split}/<class>/)')
    else:
        holds = listing(present)
    raise DatasetNotFoundError(
        f'{key}: no split {split!r} under {root!r} (looked for {", ".join(tried)}, as a folder or a .tar); it '
        f'holds {holds}. Set {key} to the sub-folder to use{hint}')


def loose_images(folder: str) -> list[str]:
    """The image files directly in ``folder`` (not in a sub-folder), which an image-folder split has none of."""
    if not os.path.isdir(folder):
        return []
    return [entry.name for entry in os.scandir(folder) if not entry.is_dir() and not entry.name.startswith('.')
            and is_image_file(entry.name)]


def non_image_files(split: str) -> list[str]:
    """The files of an image-folder split (a folder or a ``.tar``) that its reader leaves out, as paths relative to
    it in natural order: files at any depth that are not of an image type, links that point nowhere (in a folder) and
    links or other members that are not files (in a tar). Hidden files (``.DS_Store``) are not data and are not
    listed; a tar inside a tar is read by timm as a folder of its own, and is not looked into here."""
    if os.path.isfile(split) and split.lower().endswith('.tar'):
        return _tar_non_image_members(split)
    left_out = []
    for parent, folders, files in os.walk(split, followlinks=True):
        folders[:] = [name for name in folders if not name.startswith('.')]
        left_out.extend(os.path.relpath(os.path.join(parent, name), split) for name in files
                        if not name.startswith('.') and not is_image_file(name))
    return sorted(left_out, key=natural_key)


def _tar_non_image_members(path: str) -> list[str]:
    """The members of a tar that timm's tar reader leaves out (headers only are read: a tar is not decompressed);
    members whose paths lead out of the archive are listed by :func:`tar_members_outside` instead."""
    return sorted((member.name for member in _tar_members(path) if not member.isdir()
                   and not os.path.basename(member.name).startswith('.') and not leads_outside(member.name)
                   and not (member.isfile() and (is_image_file(member.name) or member.name.lower().endswith('.tar')))),
                  key=natural_key)


def _tar_members(path: str) -> list[tarfile.TarInfo]:
    try:
        with tarfile.open(path) as tar:
            return tar.getmembers()
    except (tarfile.TarError, OSError):
        return []  # timm's reader says what is wrong with the file


def leads_outside(member_name: str) -> bool:
    """Whether a tar member's path leads out of the archive's tree: an absolute path, or one with a ``..`` part.
    timm's reader would take the folder above such a member for its class (``../../outside/x.png`` is a class
    ``outside``), and a tool that extracts the archive would write it outside the folder extracted into."""
    return member_name.startswith('/') or '..' in member_name.split('/')


def tar_members_outside(split: str) -> list[str]:
    """The members of a ``.tar`` split whose paths lead out of the archive (:func:`leads_outside`), in natural order
    ([] for a folder split); the training and evaluation splits skip them (headers only are read)."""
    if not (os.path.isfile(split) and split.lower().endswith('.tar')):
        return []
    return sorted((member.name for member in _tar_members(split) if leads_outside(member.name)), key=natural_key)


def check_torchvision_split(dataset: str, split: str, key: str) -> None:
    """Refuse a split name with which timm would silently pick the test set of a torchvision dataset (``key``: the
    config key or option that named it, for the message)."""
    name = dataset.split('/', 1)[1].lower()
    if name in _TORCHVISION_TRAIN_TEST and split not in (*TRAIN_NAMES, 'test', *EVAL_NAMES):
        raise DatasetNotFoundError(
            f'{key}: {split!r} is not a split of torchvision\'s {name}, which has a training set ('
            f'{" or ".join(TRAIN_NAMES)}) and a test set (test, or {", ".join(EVAL_NAMES)})')


def class_folders_without_images(root: str, class_to_idx: Mapping[str, int]) -> list[str]:
    """Class folders directly under ``root`` that hold no image at any depth (the reader never sees them)."""
    if not os.path.isdir(root):
        return []
    empty = []
    for entry in os.scandir(root):
        if entry.name.startswith('.') or not entry.is_dir() or entry.name in class_to_idx:
            continue
        if not any(is_image_file(f) for _, _, files in os.walk(entry.path) for f in files):
            empty.append(entry.name)
    return empty


def check_split_classes(found: Iterable[str], reference: Iterable[str], where: str, source: str,
                        error: type[Exception] = DatasetError) -> None:
    """Check that every class of a split is among the classes it is scored with, so each gets its right index.

    Args:
        found: The split's class folder names.
        reference: The class names it is labelled with (the run's class map, a model's saved classes).
        where: The split, for the message (``data.val_split: '<folder>'``).
        source: What ``reference`` is, for the message (``the training split's classes``).
        error: The exception to raise.

    Raises:
        error: The split has classes the reference lacks (extra or renamed folders).
    """
    found, reference = list(found), list(reference)
    unknown = [name for name in found if name not in reference]
    if unknown:
        raise error(f'{where} has class folders that are not among {source}: {listing(unknown)} ({source}: '
                    f'{listing(reference)}). Their images could only be scored against the wrong labels; rename '
                    f'those folders to the class they hold, or remove them')
    missing = [name for name in reference if name not in found]
    if missing:
        _logger.info('%s has no images of %d of %d classes (%s); the others are scored by their names among %s',
                     where, len(missing), len(reference), listing(missing), source)
