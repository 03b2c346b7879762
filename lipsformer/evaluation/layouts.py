"""Image lists with labels for ImageNet val, ImageNet-V2 and plain class-folder data sets.

Each reader checks the class folders against the layout it expects before anything is scored, because a layout
read the wrong way does not crash: it silently scores at chance. The known traps:

- ImageNet val must be in folders named by WordNet synset; class index = position in the sorted synset list
  (timm's ``imagenet_synsets.txt``), so any subset of the 1000 folders (an Imagenette-style tree of 10) is labelled
  exactly. Folders named 1..1000 are ILSVRC2012 devkit IDs, whose order differs.
- ImageNet-V2 releases use folders ``0``..``999`` that are class indices (any subset of them). A string sort (``0, 1,
  10, 100, ...``), which torchvision's ImageFolder does, scrambles 990 of the 1000 labels; here each folder maps by
  integer value.
"""
import functools
import logging
import os
from dataclasses import dataclass
from typing import Any

from timm.data import ImageNetInfo
from timm.utils.misc import natural_key

from ..data.images import IMAGE_EXTENSIONS, is_image_file
from ..data.splits import check_split_classes
from .errors import EvaluationError

__all__ = ['ImageList', 'check_imagenet_class_names', 'imagenet_synsets', 'list_imagenet_val', 'list_imagenet_v2',
           'list_image_folder']

IMAGENET_NUM_CLASSES = 1000

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ImageList:
    """Image files of one data set in evaluation order, with their class indices.

    Attributes:
        root: The data set folder.
        paths: Image files, naturally sorted by their path relative to ``root``.
        targets: Class index of each file.
        layout: How class folders were read (``synset``, ``v2-numeric`` or ``imagefolder``), or ``dataset``.
        num_classes: Number of classes the layout defines.
        source: For ``dataset``: the timm / torchvision dataset the images and their labels are read from (then
            ``paths`` only name its samples and ``targets`` is empty).
        left_out: Files in the class folders that are not read: not of an image type (:data:`IMAGE_EXTENSIONS`), or
            in a folder below a class folder; reported as skipped.
    """
    root: str
    paths: list[str]
    targets: list[int]
    layout: str
    num_classes: int
    source: Any = None
    left_out: tuple[str, ...] = ()

    @property
    def classes_present(self) -> int:
        """Classes with at least one image here (of :attr:`num_classes`)."""
        return len(set(self.targets))


@functools.lru_cache(maxsize=1)
def _bundled_synsets() -> tuple[str, ...]:
    return tuple(ImageNetInfo('imagenet-1k').label_names())


def imagenet_synsets() -> list[str]:
    """The 1000 ImageNet-1k synsets in class-index order (sorted), as bundled with timm."""
    return list(_bundled_synsets())


def _examples(names: list[str] | set[str], limit: int = 5) -> str:
    names = sorted(names, key=natural_key)
    return ', '.join(names[:limit]) + (f' ... ({len(names)} in all)' if len(names) > limit else '')


def _class_folders(root: str | os.PathLike, what: str) -> tuple[str, list[str]]:
    """The class folder names under ``root``; errors for a missing or empty folder, or loose images in it."""
    root = os.path.abspath(os.fspath(root))
    if not os.path.isdir(root):
        raise EvaluationError(f'{what} folder {root!r} does not exist or is not a folder')
    with os.scandir(root) as entries:
        entries = list(entries)
    folders = [e.name for e in entries if e.is_dir() and not e.name.startswith('.')]
    loose_images = [e.name for e in entries if not e.is_dir() and is_image_file(e.name)]
    if loose_images:
        raise EvaluationError(
            f'{what} folder {root!r} has {len(loose_images)} images directly inside it ({_examples(loose_images)}); '
            f'images must be sorted into one sub-folder per class (for ImageNet val, the 1000 synset folders that '
            f'the usual valprep.sh script creates)')
    if not folders:
        raise EvaluationError(f'{what} folder {root!r} has no class sub-folders')
    return root, folders


def _collect(root: str, class_to_idx: dict[str, int], layout: str, num_classes: int, what: str) -> ImageList:
    """List the image files of every class folder, naturally sorted by relative path, and the files left out.

    A class folder's image files are read, links that point nowhere too (each is then skipped as unreadable, with
    the reason); its other files, the files of any folder inside it and the files beside the class folders (a
    README, a label file) are left out and reported as skipped.
    """
    samples = []
    with os.scandir(root) as entries:
        left_out = [e.name for e in entries if not e.name.startswith('.') and not e.is_dir()]
    for folder, target in class_to_idx.items():
        with os.scandir(os.path.join(root, folder)) as entries:
            entries = [e for e in entries if not e.name.startswith('.')]
        samples.extend((os.path.join(folder, e.name), target) for e in entries
                       if not e.is_dir() and is_image_file(e.name))
        left_out.extend(os.path.join(folder, e.name) for e in entries if not e.is_dir() and not is_image_file(e.name))
        left_out.extend(os.path.join(folder, e.name, name) for e in entries if e.is_dir()
                        for name in _files_below(e.path))
    types = ' '.join(sorted(IMAGE_EXTENSIONS))
    if not samples:
        others = f'; it holds {len(left_out)} other files ({_examples(left_out)})' if left_out else ''
        raise EvaluationError(
            f'{what} folder {root!r} has its {len(class_to_idx)} class folders but no images directly in them '
            f'(looked for {types}){others}')
    if left_out:
        _logger.warning('%s folder %r: skipping %d files that are not images directly in a class folder (read: %s): '
                        '%s', what, root, len(left_out), types, _examples(left_out))
    samples.sort(key=lambda sample: natural_key(sample[0]))
    return ImageList(
        root=root,
        paths=[os.path.join(root, relative) for relative, _ in samples],
        targets=[target for _, target in samples],
        layout=layout,
        num_classes=num_classes,
        left_out=tuple(os.path.join(root, relative) for relative in sorted(left_out, key=natural_key)),
    )


def _files_below(folder: str) -> list[str]:
    """The files (not hidden) at any depth under ``folder``, relative to it: a folder inside a class folder."""
    below = []
    for parent, folders, files in os.walk(folder, followlinks=True):
        folders[:] = [name for name in folders if not name.startswith('.')]
        below.extend(os.path.relpath(os.path.join(parent, name), folder) for name in files if not name.startswith('.'))
    return below


def _explain_wrong_folders(root: str, folders: list[str], synsets: list[str], what: str) -> EvaluationError:
    """An error saying what the class folders look like instead of ImageNet-1k synsets, and what to do."""
    found = set(folders)
    numeric = all(name.isdigit() for name in folders)
    if numeric and found == {str(i) for i in range(1, IMAGENET_NUM_CLASSES + 1)}:
        reason = ('its folders are named 1..1000, the ILSVRC2012 devkit class IDs, whose order is not the sorted '
                  'synset order models are trained with. Rename each folder to its synset (the devkit meta.mat '
                  'maps ILSVRC2012_ID to WNID)')
    elif numeric and found <= _v2_folder_names():
        reason = ('its folders are named by numbers in 0..999, the ImageNet-V2 layout: pass this folder with '
                  '--v2-dir instead')
    elif numeric:
        reason = f'its {len(found)} folders have numeric names ({_examples(found)}), not ImageNet synsets'
    else:
        unexpected = found - set(synsets)
        reason = (f'{len(unexpected)} of its {len(found)} class folders are not ImageNet-1k synsets: '
                  f'{_examples(unexpected)}. Every folder must be named by its synset (any subset of the '
                  f'{IMAGENET_NUM_CLASSES} is fine); for a data set with its own classes use --data-layout imagefolder')
    return EvaluationError(f'{what} folder {root!r} is not in the ImageNet layout: {reason}')


def _v2_folder_names() -> set[str]:
    return {str(i) for i in range(IMAGENET_NUM_CLASSES)}


def _synset_classes(folders: list[str]) -> dict[str, int] | None:
    """Each folder's class index when every folder is an ImageNet-1k synset (any subset), else None."""
    index = {synset: position for position, synset in enumerate(imagenet_synsets())}
    return {name: index[name] for name in folders} if all(name in index for name in folders) else None


def list_imagenet_val(root: str | os.PathLike) -> ImageList:
    """ImageNet val, or any subset of its images and synset folders; class index = sorted synset position.

    Raises:
        EvaluationError: The folder is missing, has no images, or a folder is not an ImageNet-1k synset.
    """
    root, folders = _class_folders(root, 'ImageNet val')
    class_to_idx = _synset_classes(folders)
    if class_to_idx is None:
        raise _explain_wrong_folders(root, folders, imagenet_synsets(), 'ImageNet val')
    return _collect(root, class_to_idx, 'synset', IMAGENET_NUM_CLASSES, 'ImageNet val')


def list_imagenet_v2(root: str | os.PathLike) -> ImageList:
    """An ImageNet-V2 variant, or any subset of its class folders: folders ``0``..``999`` mapped by integer value,
    or the older synset-named layout.

    Raises:
        EvaluationError: The folder is missing, has no images, or its folders are neither layout.
    """
    root, folders = _class_folders(root, 'ImageNet-V2')
    if set(folders) <= _v2_folder_names():
        return _collect(root, {name: int(name) for name in folders}, 'v2-numeric', IMAGENET_NUM_CLASSES,
                        'ImageNet-V2')
    class_to_idx = _synset_classes(folders)
    if class_to_idx is not None:
        return _collect(root, class_to_idx, 'synset', IMAGENET_NUM_CLASSES, 'ImageNet-V2')
    if all(name.isdigit() for name in folders):
        unexpected = set(folders) - _v2_folder_names()
        raise EvaluationError(
            f'ImageNet-V2 folder {root!r} must have class folders named 0..999 (any subset of them, each the class '
            f'index written without leading zeros); not class indices: {_examples(unexpected)}')
    raise _explain_wrong_folders(root, folders, imagenet_synsets(), 'ImageNet-V2')


def list_image_folder(root: str | os.PathLike, class_names: list[str] | None = None) -> ImageList:
    """Any class-folder data set. With the model's ``class_names`` (saved with its weights), a folder's class index
    is the position of its name there, and folders may be missing; without them, it is the position of the folder
    name in natural sort order, as timm's ImageFolder reader (and so train.py) assigns it.

    Raises:
        EvaluationError: The folder is missing, has no class folders or no images, or has a class folder that
            ``class_names`` lacks.
    """
    root, folders = _class_folders(root, 'image')
    if class_names is None:
        class_to_idx = {name: index for index, name in enumerate(sorted(folders, key=natural_key))}
        return _collect(root, class_to_idx, 'imagefolder', len(class_to_idx), 'image')
    check_split_classes(folders, class_names, f'image folder {root!r}', 'the classes saved with the model\'s weights',
                        error=EvaluationError)
    index = {name: position for position, name in enumerate(class_names)}
    return _collect(root, {name: index[name] for name in folders}, 'imagefolder', len(class_names), 'image')


def check_imagenet_class_names(class_names: list[str] | None) -> None:
    """Refuse a model whose saved classes are ImageNet synsets in another order than the layouts' (sorted) one.

    Raises:
        EvaluationError: They are.
    """
    synsets = imagenet_synsets()
    if class_names is not None and set(class_names) & set(synsets) and list(class_names) != synsets:
        raise EvaluationError(
            f'the model\'s classes, saved with its weights ({len(class_names)}: {_examples(class_names)}), are not '
            f'the {IMAGENET_NUM_CLASSES} ImageNet-1k synsets in sorted order, which the ImageNet layouts label by; '
            f'score it with --data-layout imagefolder, which labels each folder by its name')
