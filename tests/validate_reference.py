"""The independent computation validate.py's numbers are checked against: logits of the same weights, top-k, and
accuracy as 100 * hits / count, written without any of lipsformer.evaluation's code."""
import torch
from PIL import Image
from timm.data import create_transform


def reference_topk(model: torch.nn.Module, paths: list[str], data_config: dict,
                   min_margin: float | None = 1e-5) -> torch.Tensor:
    """Top-5 class indices per image, from one batch of all images.

    Args:
        model: The classifier, in eval mode.
        paths: Image files.
        data_config: timm eval preprocessing.
        min_margin: Smallest logit gap allowed at the top-1 and top-5 boundaries, so that decisions do not hinge
            on rounding that differs between batchings (None where the compared run computes the very same batch).
    """
    transform = create_transform(**data_config, is_training=False)
    images = []
    for path in paths:
        with Image.open(path) as image:
            images.append(transform(image.convert('RGB')))
    with torch.no_grad():
        logits = model(torch.stack(images))
    ranked = logits.float().sort(dim=1, descending=True).values
    if min_margin is not None:
        assert (ranked[:, 0] - ranked[:, 1]).min() > min_margin and (ranked[:, 4] - ranked[:, 5]).min() > min_margin
    return logits.float().topk(5, dim=1).indices


def reference_accuracy(topk: torch.Tensor, label_sets: list[list[int]]) -> dict:
    """count / top1 / top5 (percent) over images with a non-empty label set."""
    counted = [(row.tolist(), labels) for row, labels in zip(topk, label_sets) if labels]
    top1 = sum(row[0] in labels for row, labels in counted)
    top5 = sum(any(c in labels for c in row) for row, labels in counted)
    return {'count': len(counted), 'top1': 100.0 * top1 / len(counted), 'top5': 100.0 * top5 / len(counted)}


def file_by_prediction(topk: torch.Tensor) -> list[int]:
    """A class per image: its top-1 prediction (i % 3 == 0), its 5th (== 1), or one outside its top 5 (== 2)."""
    classes = []
    for i, row in enumerate(topk.tolist()):
        if i % 3 == 0:
            classes.append(row[0])
        elif i % 3 == 1:
            classes.append(row[4])
        else:
            classes.append(next(c for c in range(1000) if c not in row))
    return classes
