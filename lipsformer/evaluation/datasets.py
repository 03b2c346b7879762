"""Evaluate one model on the requested data sets: ImageNet val (with ReaL from the same pass), ImageNet-V2
variants and plain class folders.

Every folder is listed and checked before the first image is read, so a wrong layout or label file fails in
seconds, not after an hour of inference.
"""
import logging
import os
from dataclasses import dataclass, field

import torch
from accelerate import Accelerator

from .errors import EvaluationError
from .layouts import ImageList, check_imagenet_class_names, list_image_folder, list_imagenet_v2, list_imagenet_val
from .metrics import Score, score_label_sets, score_labels
from .predict import InferenceSettings, predict
from .real import real_labels_for

__all__ = ['DataRequest', 'DatasetResult', 'PlannedPass', 'plan_datasets', 'evaluate']

_logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DataRequest:
    """What to evaluate on.

    Attributes:
        data_dir: ImageNet val folder (or a class-folder data set with ``layout='imagefolder'``).
        layout: ``imagenet`` or ``imagefolder`` for ``data_dir``.
        real_labels: ReaL label sets by file name, to score ``data_dir`` against them too.
        v2_dirs: ImageNet-V2 variant folders.
        class_names: The model's classes, saved with its weights: class folders are labelled by these names.
    """
    data_dir: str | None = None
    layout: str = 'imagenet'
    real_labels: dict[str, list[int]] | None = None
    v2_dirs: tuple[str, ...] = ()
    class_names: list[str] | None = None


@dataclass(frozen=True)
class DatasetResult:
    """One row of the results: a data set scored by one model.

    Attributes:
        dataset: ``imagenet``, ``imagenet-real``, ``imagenet-v2`` or ``imagefolder``.
        name: Folder name (tells V2 variants apart).
        path: The data set folder.
        images: Image files found.
        count: Images that counted (readable, and for ReaL with a non-empty label set).
        top1: Top-1 accuracy in percent (``None`` if nothing counted).
        top5: Top-5 accuracy in percent (top-k with k = number of classes below 5).
        images_per_s: Throughput of the pass that produced the predictions.
        skipped: Unreadable image files, left out.
    """
    dataset: str
    name: str
    path: str
    images: int
    count: int
    top1: float | None
    top5: float | None
    images_per_s: float
    skipped: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class PlannedPass:
    """One inference pass over an image list and the data sets scored from it."""
    dataset: str
    images: ImageList
    real_label_sets: list[list[int]] | None = None


def plan_datasets(request: DataRequest) -> list[PlannedPass]:
    """List and check every requested folder (and match ReaL names) before any inference."""
    if request.data_dir is None and not request.v2_dirs:
        raise EvaluationError('nothing to evaluate: give --data-dir and/or --v2-dir')
    if request.real_labels is not None and (request.data_dir is None or request.layout != 'imagenet'):
        raise EvaluationError('--real-labels scores ImageNet val: it needs --data-dir with the imagenet layout')
    if request.v2_dirs or (request.data_dir is not None and request.layout == 'imagenet'):
        check_imagenet_class_names(request.class_names)
    passes = []
    if request.data_dir is not None:
        if request.layout == 'imagenet':
            images = list_imagenet_val(request.data_dir)
            real = real_labels_for(images.paths, request.real_labels) if request.real_labels is not None else None
            passes.append(PlannedPass('imagenet', images, real))
        else:
            passes.append(PlannedPass('imagefolder', list_image_folder(request.data_dir, request.class_names)))
    passes.extend(PlannedPass('imagenet-v2', list_imagenet_v2(path)) for path in request.v2_dirs)
    return passes


def _result(dataset: str, images: ImageList, score: Score, images_per_s: float, skipped: list[str]) -> DatasetResult:
    return DatasetResult(
        dataset=dataset, name=os.path.basename(os.path.normpath(images.root)), path=images.root,
        images=len(images.paths), count=score.count, top1=score.top1, top5=score.topk, images_per_s=images_per_s,
        skipped=skipped)


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
        if model.num_classes != planned.images.num_classes:
            raise EvaluationError(
                f'the model has {model.num_classes} outputs but {planned.dataset} at {planned.images.root!r} has '
                f'{planned.images.num_classes} classes; evaluate a checkpoint trained on this label space')
    results = []
    for planned in passes:
        predictions = predict(model, planned.images.paths, data_config, accelerator, settings, name=planned.dataset)
        skipped = [path for path, ok in zip(planned.images.paths, predictions.readable.tolist()) if not ok]
        if skipped:
            _logger.warning('%s: skipped %d unreadable images, e.g. %s', planned.dataset, len(skipped), skipped[0])
        images_per_s = len(planned.images.paths) / predictions.seconds
        targets = torch.tensor(planned.images.targets)
        score = score_labels(predictions.topk, targets, predictions.readable)
        results.append(_result(planned.dataset, planned.images, score, images_per_s, skipped))
        if planned.real_label_sets is not None:
            real_score = score_label_sets(predictions.topk, planned.real_label_sets, predictions.readable)
            results.append(_result('imagenet-real', planned.images, real_score, images_per_s, skipped))
    return results
