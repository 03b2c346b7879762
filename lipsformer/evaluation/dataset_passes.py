"""Evaluate one model on the requested data sets: ImageNet val (with ReaL from the same pass), ImageNet-V2
variants, plain class folders and any dataset timm's ``create_dataset`` opens (``torch/<name>``, ``hfds/<name>``).

Every folder is listed and checked before the first image is read, so a wrong layout or label file fails in
seconds, not after an hour of inference.
"""
import logging
import os
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator
from timm.data import create_dataset
from timm.utils.misc import natural_key
from torch.utils.data import Dataset, IterableDataset

from ..data import (
    DatasetError,
    DatasetNotFoundError,
    RobustDataset,
    check_torchvision_split,
    class_names_of,
    decode_here,
    num_classes_of,
    prepare_dataset,
    split_folder,
)
from ..data.images import IMAGE_EXTENSIONS
from ..data.sources import every_image_type, is_image_folder
from ..data.splits import TRAIN_NAMES, listing, loose_images, non_image_files
from .errors import EvaluationError
from .layouts import ImageList, check_imagenet_class_names, list_image_folder, list_imagenet_v2, list_imagenet_val
from .metrics import Score, score_label_sets, score_labels
from .predict import InferenceSettings, predict
from .real import real_labels_for

__all__ = ['DataRequest', 'DatasetResult', 'PlannedPass', 'plan_datasets', 'evaluate', 'split_of']

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataRequest:
    """What to evaluate on.

    Attributes:
        data_dir: ImageNet val folder (or a class-folder data set with ``layout='imagefolder'``), or, as timm's
            validate.py reads ``--data-dir``, the data set root holding that folder as its ``split`` sub-folder.
        layout: ``imagenet`` or ``imagefolder`` for ``data_dir``.
        real_labels: ReaL label sets by file name, to score ``data_dir`` against them too.
        v2_dirs: ImageNet-V2 variant folders.
        class_names: The model's classes, saved with its weights: class folders are labelled by these names.
        dataset: A timm dataset name (``torch/cifar10``, ``hfds/<repo>``) read with ``data_dir`` as its root.
        split: The split of ``dataset``, or the sub-folder of ``data_dir`` to score (a name or a synonym timm
            accepts: ``val`` for ``validation``, ...); None: ``validation``, and ``data_dir`` itself when it has no
            such sub-folder.
        download: Let torchvision / Hugging Face download ``dataset`` when missing.
    """
    data_dir: str | None = None
    layout: str = 'imagenet'
    real_labels: dict[str, list[int]] | None = None
    v2_dirs: tuple[str, ...] = ()
    class_names: list[str] | None = None
    dataset: str | None = None
    split: str | None = None
    download: bool = False


@dataclass(frozen=True)
class DatasetResult:
    """One row of the results: a data set scored by one model.

    Attributes:
        dataset: ``imagenet``, ``imagenet-real``, ``imagenet-v2`` or ``imagefolder``.
        name: Folder name (tells V2 variants apart).
        path: The data set folder.
        images: Files found: the images read and the files left out (``skipped`` names those, and the unreadable).
        count: Images that counted (readable, and for ReaL with a non-empty label set).
        top1: Top-1 accuracy in percent (``None`` if nothing counted).
        top5: Top-5 accuracy in percent (top-k with k = number of classes below 5).
        images_per_s: Throughput of the pass that produced the predictions.
        classes: Classes with at least one image in the data set (a subset of ImageNet has fewer than 1000).
        num_classes: Classes of the label space (1000 for the ImageNet layouts).
        skipped: Files not scored: unreadable images, and files that are not images in a class folder.
    """
    dataset: str
    name: str
    path: str
    images: int
    count: int
    top1: float | None
    top5: float | None
    images_per_s: float
    classes: int
    num_classes: int
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlannedPass:
    """One inference pass over an image list and the data sets scored from it."""
    dataset: str
    images: ImageList
    real_label_sets: list[list[int]] | None = None


def plan_datasets(request: DataRequest) -> list[PlannedPass]:
    """List and check every requested folder (and match ReaL names) before any inference."""
    if request.data_dir is None and not request.v2_dirs and not request.dataset:
        raise EvaluationError('nothing to evaluate: give --data-dir, --v2-dir and/or --dataset')
    if request.real_labels is not None and (request.data_dir is None or request.layout != 'imagenet'
                                            or request.dataset):
        raise EvaluationError('--real-labels scores ImageNet val: it needs --data-dir with the imagenet layout')
    if request.v2_dirs or (request.data_dir is not None and request.layout == 'imagenet' and not request.dataset):
        check_imagenet_class_names(request.class_names)
    passes = []
    if request.dataset:
        passes.append(PlannedPass(request.dataset, open_named_dataset(request)))
    elif request.data_dir is not None:
        folder = split_of(request.data_dir, request.split)
        if request.layout == 'imagenet':
            images = list_imagenet_val(folder)
            real = real_labels_for(images.paths, request.real_labels) if request.real_labels is not None else None
            passes.append(PlannedPass('imagenet', images, real))
        else:
            passes.append(PlannedPass('imagefolder', list_image_folder(folder, request.class_names)))
    passes.extend(PlannedPass('imagenet-v2', list_imagenet_v2(path)) for path in request.v2_dirs)
    for planned in passes:
        if planned.images.source is None and planned.images.classes_present < planned.images.num_classes:
            _logger.info('%s at %s: %d of the %d classes present, %d images', planned.dataset, planned.images.root,
                         planned.images.classes_present, planned.images.num_classes, len(planned.images.paths))
    return passes


def split_of(data_dir: str, split: str | None) -> str:
    """The folder ``--data-dir DATA_DIR [--split SPLIT]`` means, as timm's validate.py finds it: ``DATA_DIR/SPLIT``
    (or a synonym timm accepts: ``val``, ``valid``, ... for ``validation``). Without ``--split``: the validation
    split's folder when DATA_DIR has one, else DATA_DIR itself, the folder of the images to score.

    Raises:
        EvaluationError: ``--split`` was given and DATA_DIR holds no such split.
    """
    try:
        return split_folder(data_dir, split or 'validation', '--split', '--data-dir')
    except DatasetNotFoundError as e:
        if split is None:
            return data_dir
        raise EvaluationError(str(e)) from e


def open_named_dataset(request: DataRequest) -> ImageList:
    """One split of a dataset timm's ``create_dataset`` opens, as the training code opens it (the same split checks
    and offline Fashion-MNIST); each sample is named ``<split>/<index>``.

    Raises:
        EvaluationError: The dataset or the split is not there, or holds no images.
    """
    name, split = request.dataset, request.split or 'validation'
    try:
        if name.lower().startswith('torch/'):
            check_torchvision_split(name, split, 'data.split')
        prepare_dataset(name, request.data_dir, request.download, unpack=False, download_option='--dataset-download')
        _refuse_writes_unasked(name, split, request.data_dir, request.download)
        with every_image_type():
            dataset = create_dataset(name, root=request.data_dir, split=split, search_split=False,
                                     download=request.download)
    except DatasetError as e:
        raise EvaluationError(f'--dataset {name}: {e}') from e
    except (FileNotFoundError, RuntimeError, AssertionError, KeyError, ValueError) as e:
        # torchvision's own advice (download=True) is a Python argument; say the option that sets it.
        ask = ('; --dataset-download lets torchvision download it there (nothing is written into a data folder '
               'unasked)' if name.lower().startswith('torch/') and not request.download else '')
        raise EvaluationError(f'--dataset {name}: cannot open its {split!r} split under {request.data_dir!r}: '
                              f'{e or type(e).__name__}{ask}') from e
    if isinstance(dataset, IterableDataset) or len(dataset) == 0:
        raise EvaluationError(f'--dataset {name}: the {split!r} split is empty or streamed; give a map-style dataset '
                              f'(torch/<name>, hfds/<name>)')
    decode_here(dataset)  # EvalImageDataset reads the bytes with the package's reader
    root = request.data_dir or name
    source, num_classes = RobustDataset(dataset, is_training=False), num_classes_of(dataset) or 0
    names = class_names_of(dataset)
    if request.class_names is not None and names is not None and list(names) != list(request.class_names):
        source, num_classes = ClassesByName(source, _model_indices(name, names, request.class_names)), len(
            request.class_names)
        _logger.info('--dataset %s: its classes are labelled by their names among the %d classes saved with the '
                     'model\'s weights (the two number them differently)', name, num_classes)
    return ImageList(root=root, paths=[f'{split}/{i}' for i in range(len(dataset))], targets=[], layout='dataset',
                     num_classes=num_classes, source=source, left_out=_left_out_of_folder(name, request.data_dir))


def _refuse_writes_unasked(dataset: str, split: str, data_dir: str | None, download: bool) -> None:
    """Refuse, before it is opened, a data set whose reader would write into ``--data-dir`` although
    ``--dataset-download`` was not given (Fashion-MNIST is :func:`~lipsformer.data.prepare_dataset`'s to check).

    Raises:
        EvaluationError: Hugging Face's ``datasets`` would download and cache the data set there (it writes its cache
            into the folder it is given), or torchvision would unpack ImageNet's archives there (its ``meta.bin`` and
            the split's folder are not there yet).
    """
    if download or data_dir is None:
        return
    asked = 'nothing is written into a data folder unasked: give --dataset-download to let it'
    if dataset.lower().startswith(('hfds/', 'hfids/')):
        raise EvaluationError(f'--dataset {dataset}: Hugging Face\'s datasets downloads and caches it in --data-dir '
                              f'{data_dir!r}, writing there even to read a copy it cached before; {asked}, or leave '
                              f'--data-dir out to use Hugging Face\'s own cache')
    folder = 'train' if split in TRAIN_NAMES else 'val'
    unpacked = os.path.isfile(os.path.join(data_dir, 'meta.bin')) and os.path.isdir(os.path.join(data_dir, folder))
    if dataset.lower() == 'torch/imagenet' and not unpacked:
        raise EvaluationError(f'--dataset {dataset}: torchvision unpacks ImageNet\'s archives into --data-dir '
                              f'{data_dir!r} (meta.bin and {folder}/, not there yet) when it first opens them; '
                              f'{asked}, or give the folder where it has done so')


def _left_out_of_folder(dataset: str, root: str | None) -> tuple[str, ...]:
    """The files a class-folder data set's reader leaves out (images outside a class folder, files of other types,
    links that point nowhere), logged, for the pass to report as skipped; none for other data sets."""
    if root is None or not is_image_folder(dataset) or not os.path.isdir(root):
        return ()
    left_out = sorted([*loose_images(root), *non_image_files(root)], key=natural_key)
    if left_out:
        _logger.warning('--dataset %s: skipping %d file(s) under %r that are not images in a class folder (read: %s): '
                        '%s', dataset, len(left_out), root, ' '.join(sorted(IMAGE_EXTENSIONS)), listing(left_out, 5))
    return tuple(os.path.join(root, name) for name in left_out)


def _model_indices(dataset: str, names: list[str], model_names: list[str]) -> tuple[int, ...]:
    """The model's class index of each class of a data set, found by name.

    Raises:
        EvaluationError: A class of the data set is not among the model's (or a name is there twice).
    """
    position = {class_name: index for index, class_name in enumerate(model_names)}
    unknown = [class_name for class_name in names if class_name not in position]
    if unknown or len(set(names)) != len(names) or len(position) != len(model_names):
        raise EvaluationError(
            f'--dataset {dataset}: its classes are not among those saved with the model\'s weights, so its labels '
            f'would be scored against the wrong outputs ({listing(unknown, 20) if unknown else "a name given twice"}). '
            f'Its classes: {listing(names, 100)}; the model\'s: {listing(model_names, 100)}. Score it with a model '
            f'trained on these classes')
    return tuple(position[class_name] for class_name in names)


class ClassesByName(Dataset):
    """A data set's ``(image, target)`` samples with each target renumbered to the model's index of its class (a
    negative target, an unreadable image, is kept)."""

    def __init__(self, dataset: Dataset, model_indices: tuple[int, ...]):
        self.dataset = dataset
        self.model_indices = model_indices

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[object, int]:
        image, target = self.dataset[index]
        return image, self.model_indices[target] if target >= 0 else target


def _result(dataset: str, images: ImageList, score: Score, images_per_s: float, skipped: list[str],
            targets: torch.Tensor) -> DatasetResult:
    name = images.paths[0].split('/')[0] if images.source is not None else os.path.basename(
        os.path.normpath(images.root))
    return DatasetResult(
        dataset=dataset, name=name, path=images.root, images=len(images.paths) + len(images.left_out),
        count=score.count, top1=score.top1,
        top5=score.topk, images_per_s=images_per_s, classes=len(set(targets[targets >= 0].tolist())),
        num_classes=images.num_classes, skipped=skipped)


def evaluate(
        model: torch.nn.Module,
        passes: list[PlannedPass],
        data_config: dict,
        accelerator: Accelerator,
        settings: InferenceSettings = InferenceSettings(),
) -> list[DatasetResult]:
    """Predict on each planned image list and score it (ReaL from the val pass's predictions).

    Raises:
        EvaluationError: The model's class count does not fit a data set.
    """
    for planned in passes:
        if planned.images.num_classes and model.num_classes != planned.images.num_classes:
            raise EvaluationError(
                f'the model has {model.num_classes} outputs but {planned.dataset} at {planned.images.root!r} has '
                f'{planned.images.num_classes} classes; evaluate a checkpoint trained on this label space')
    results = []
    for planned in passes:
        predictions = predict(model, planned.images.paths, data_config, accelerator, settings, name=planned.dataset,
                              source=planned.images.source)
        unreadable = [path for path, ok in zip(planned.images.paths, predictions.readable.tolist()) if not ok]
        if unreadable:
            _logger.warning('%s: skipped %d unreadable images, e.g. %s', planned.dataset, len(unreadable),
                            unreadable[0])
        skipped = sorted([*planned.images.left_out, *unreadable], key=natural_key)
        images_per_s = len(planned.images.paths) / predictions.seconds
        targets = predictions.targets if planned.images.source is not None else torch.tensor(planned.images.targets)
        score = score_labels(predictions.topk, targets, predictions.readable)
        results.append(_result(planned.dataset, planned.images, score, images_per_s, skipped, targets))
        if planned.real_label_sets is not None:
            real_score = score_label_sets(predictions.topk, planned.real_label_sets, predictions.readable)
            results.append(_result('imagenet-real', planned.images, real_score, images_per_s, skipped, targets))
    return results
