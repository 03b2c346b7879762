"""LipsFormer (Qi et al., ICLR 2023) for timm: importing this package registers every LipsFormer model with timm.

- :mod:`.models` (LipsFormer-Swin and -CSwin) built from :mod:`.layers` (one Lipschitz concept per file);
- :mod:`.checkpoint`: weight files of any layout (timm, exports, the authors'), loaded without running pickled code;
  :mod:`.convert` makes timm model folders of them, :mod:`.hub` model cards, Hub uploads and ``hf-hub:`` /
  ``local-dir:`` names;
- :mod:`.training` (train.py), :mod:`.evaluation` (validate.py), :mod:`.lipschitz` (bounds, estimates, constrained
  training) and :mod:`.experiments` (the paper's claims in miniature);
- :mod:`.complexity` and :mod:`.benchmark`: parameters, MACs, speed and memory; :mod:`.cpu_memory`: CPU allocator
  tuning; :mod:`.utils`: crash-safe file writes and machine facts shared by all of them.
"""
from . import checkpoint, models
from .models import LipsFormerCSwin, LipsFormerSwin

__version__ = '0.1.0'
__all__ = ['LipsFormerCSwin', 'LipsFormerSwin', 'checkpoint', 'models']
