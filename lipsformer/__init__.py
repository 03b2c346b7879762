"""LipsFormer (Qi et al., ICLR 2023) for timm: importing this package registers every LipsFormer model with timm.

The parts, each depending only on those listed before it:

- :mod:`.utils`: crash-safe file writes, machine facts, process start-up and teardown, what the commands share;
- :mod:`.fastpath`: the optional faster kernels behind one switch;
- :mod:`.layers` (one Lipschitz concept per file) and :mod:`.models` (LipsFormer-Swin and -CSwin) built from them,
  needing torch, timm and the fast path alone: their builder explains pretrained weights that cannot be had;
- :mod:`.weight_files`: weight files of any layout (timm, exports, the authors'), read without running pickled code;
  :mod:`.model_names`: ``hf-hub:`` / ``local-dir:`` and registered names, resolved the same way by every command;
  :mod:`.model_folder`: the timm model folders that exports and conversions write;
- :mod:`.data`: the data readers (image folders, torchvision and Hugging Face data sets, WebDataset shards,
  Fashion-MNIST's IDX files) that training, evaluation and the experiments share;
- :mod:`.lipschitz` (bounds, estimates, constrained training), :mod:`.complexity` (parameters, MACs) and
  :mod:`.cpu_memory` (CPU allocator tuning);
- :mod:`.training` (train.py), :mod:`.evaluation` (validate.py), :mod:`.hub` (model cards, uploads),
  :mod:`.convert` and :mod:`.experiments` (the paper's claims in miniature);
- the instruments: :mod:`.model_specs` (the model specs they take), :mod:`.kernel_count` (kernels and bytes of one
  CUDA step, counted without a GPU), :mod:`.step_profile`, :mod:`.benchmark` and :mod:`.gpu_check` (the GPU check).
"""
import importlib
from types import ModuleType

from . import models
from .models import LipsFormerCSwin, LipsFormerSwin

__version__ = '0.1.0'
__all__ = ['LipsFormerCSwin', 'LipsFormerSwin', 'models', 'weight_files']


def __getattr__(name: str) -> ModuleType:
    """``lipsformer.weight_files`` imported when it is first used: importing the package registers the models and
    imports nothing else of it."""
    if name == 'weight_files':
        return importlib.import_module(f'.{name}', __name__)
    raise AttributeError(f'module {__name__!r} has no attribute {name!r}')
