"""ImageNet-ReaL labels (Beyer et al., "Are we done with ImageNet?", 2020) on any subset of ImageNet val.

ReaL gives each val image a set of acceptable classes, possibly empty; a prediction is right when it is in the set.
Images with an empty set are left out of numerator and denominator, as in the authors' and timm's scoring. Unlike
timm's ``RealLabelsImagenet``, which needs all 50,000 images, the labels here are matched by file name, so a subset
(or a shard) is scored over the images it has.
"""
import json
import os
import pkgutil
import re

from .errors import EvaluationError
from .layouts import IMAGENET_NUM_CLASSES

__all__ = ['load_real_labels', 'real_labels_for']

_VAL_NAME = re.compile(r'ILSVRC2012_val_(\d{8})\.JPEG')
_NUM_VAL_IMAGES = 50_000


def _val_file_name(number: int) -> str:
    return f'ILSVRC2012_val_{number:08d}.JPEG'


def _check_label_set(labels: object, where: str) -> list[int]:
    if not isinstance(labels, list) or not all(
            isinstance(label, int) and 0 <= label < IMAGENET_NUM_CLASSES for label in labels):
        raise EvaluationError(f'{where}: expected a list of class indices in 0..999, got {labels!r:.80}')
    return labels


def load_real_labels(path: str | os.PathLike | None = None) -> dict[str, list[int]]:
    """ReaL label sets keyed by val file name.

    Args:
        path: ``real.json`` as published (a list of 50,000 label lists, entry i for
            ``ILSVRC2012_val_{i+1:08d}.JPEG``) or a dict from file name to label list; ``None`` uses the copy
            bundled with timm.

    Raises:
        EvaluationError: The file is missing, is not JSON, or does not hold label lists.
    """
    if path is None:
        source = 'timm bundled imagenet_real_labels.json'
        raw = json.loads(pkgutil.get_data('timm.data', '_info/imagenet_real_labels.json').decode('utf-8'))
    else:
        source = os.fspath(path)
        try:
            with open(source, encoding='utf-8') as f:
                raw = json.load(f)
        except OSError as e:
            raise EvaluationError(f'cannot read ReaL labels {source!r}: {e.strerror}') from e
        except json.JSONDecodeError as e:
            raise EvaluationError(f'ReaL labels {source!r} are not valid JSON: {e}') from e
    if isinstance(raw, list):
        if len(raw) != _NUM_VAL_IMAGES:
            raise EvaluationError(
                f'ReaL labels {source!r} hold {len(raw)} entries; the published real.json has one per val image '
                f'({_NUM_VAL_IMAGES}). For other sets write a dict from file name to label list')
        return {_val_file_name(i + 1): _check_label_set(labels, f'{source} entry {i}') for i, labels in enumerate(raw)}
    if isinstance(raw, dict):
        return {name: _check_label_set(labels, f'{source} entry {name!r}') for name, labels in raw.items()}
    raise EvaluationError(f'ReaL labels {source!r} must be a JSON list or dict, not {type(raw).__name__}')


def real_labels_for(paths: list[str], real_labels: dict[str, list[int]]) -> list[list[int]]:
    """The ReaL label set of each image, matched by file name.

    Raises:
        EvaluationError: Some file names have no ReaL entry (ReaL needs the official ``ILSVRC2012_val_%08d.JPEG``
            names).
    """
    names = [os.path.basename(path) for path in paths]
    unknown = [name for name in names if name not in real_labels]
    if unknown:
        renamed = sum(1 for name in unknown if not _VAL_NAME.fullmatch(name))
        hint = (f'{renamed} of them do not follow the official pattern ILSVRC2012_val_%08d.JPEG; ReaL labels are '
                f'matched by these names, so renamed or re-encoded copies of val cannot be scored'
                if renamed else 'the label file has no entry for them')
        raise EvaluationError(
            f'{len(unknown)} of {len(names)} images have no ReaL labels (e.g. {", ".join(unknown[:3])}): {hint}. '
            f'Drop --real-labels to score only the original labels')
    return [real_labels[name] for name in names]
