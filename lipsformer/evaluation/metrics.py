"""Top-1 / top-k accuracy from integer counts, for single labels and for ReaL label sets.

Counts are kept as integers and divided once, so a result equals ``100 * correct / count`` exactly, whatever the
batching or the number of processes.
"""
from dataclasses import dataclass

import torch

__all__ = ['Score', 'score_labels', 'score_label_sets']


@dataclass(frozen=True)
class Score:
    """How many images counted and how many had the label in the top 1 and top k predictions."""
    count: int
    correct_top1: int
    correct_topk: int

    @property
    def top1(self) -> float | None:
        """Top-1 accuracy in percent; ``None`` when no image counted."""
        return 100.0 * self.correct_top1 / self.count if self.count else None

    @property
    def topk(self) -> float | None:
        """Top-k accuracy in percent; ``None`` when no image counted."""
        return 100.0 * self.correct_topk / self.count if self.count else None


def score_labels(topk: torch.Tensor, targets: torch.Tensor, valid: torch.Tensor) -> Score:
    """Score predictions against one label per image.

    Args:
        topk: ``(N, k)`` class indices, best first.
        targets: ``(N,)`` true class index of each image.
        valid: ``(N,)`` bool, False for images that could not be read (left out).
    """
    hits = (topk == targets[:, None]) & valid[:, None]
    return Score(count=int(valid.sum()), correct_top1=int(hits[:, 0].sum()), correct_topk=int(hits.any(1).sum()))


def score_label_sets(topk: torch.Tensor, label_sets: list[list[int]], valid: torch.Tensor) -> Score:
    """Score predictions against a set of acceptable labels per image (ImageNet-ReaL).

    An image with an empty label set, or one that could not be read, is left out of numerator and denominator.

    Args:
        topk: ``(N, k)`` class indices, best first.
        label_sets: Acceptable class indices of each image.
        valid: ``(N,)`` bool, False for images that could not be read.
    """
    count = correct_top1 = correct_topk = 0
    for predictions, labels, readable in zip(topk.tolist(), label_sets, valid.tolist()):
        if not readable or not labels:
            continue
        count += 1
        correct_top1 += predictions[0] in labels
        correct_topk += any(prediction in labels for prediction in predictions)
    return Score(count=count, correct_top1=correct_top1, correct_topk=correct_topk)
