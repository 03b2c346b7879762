"""LipsFormer (Qi et al., ICLR 2023) for timm: importing this package registers every LipsFormer model with timm."""
from . import checkpoint, models
from .models import LipsFormerCSwin, LipsFormerSwin

__version__ = '0.1.0'
__all__ = ['LipsFormerCSwin', 'LipsFormerSwin', 'checkpoint', 'models']
