"""LipsFormer (Qi et al., ICLR 2023) for timm: importing this package registers every LipsFormer model with timm, and
imports nothing else of it; pretrained weights asked of a model are read and their failures explained by
:mod:`.weights`, imported then.

The rooms, each standing on those above it alone:

- :mod:`.utils`: crash-safe file writes, machine facts, processes, CPU memory, what the commands share;
- the network: :mod:`.fastpath` (the optional faster kernels behind one switch), :mod:`.layers` (one Lipschitz concept
  a file) and :mod:`.models` (LipsFormer-Swin and -CSwin, timm model files), on torch and timm alone;
- :mod:`.weights`: weight files of any layout read without running code, model names that carry weights, model folders;
- :mod:`.data`: the data readers that training, evaluation and the instruments share;
- :mod:`.lipschitz`: bounds, estimates and the constraint of constrained training;
- :mod:`.training` (train.py) and :mod:`.evaluation` (validate.py);
- :mod:`.hub`: conversions to timm model folders, model cards, uploads;
- :mod:`.instruments`: the benchmark, kernel counts, profiles, complexity, the GPU check, and the stability sweep
  (the paper's central claim in miniature); ``python -m lipsformer.benchmark`` runs its benchmark.
"""
import contextlib
from typing import Any

from . import models
from .models import LipsFormerCSwin, LipsFormerSwin


def _pretrained_loading(variant: str, kwargs: dict[str, Any]) -> contextlib.AbstractContextManager:
    from .weights.pretrained_sources import explaining_pretrained_failures  # only where pretrained weights are asked
    return explaining_pretrained_failures(variant, kwargs)


models.set_pretrained_loading(_pretrained_loading)

__version__ = '0.1.0'
__all__ = ['LipsFormerCSwin', 'LipsFormerSwin', 'models']
