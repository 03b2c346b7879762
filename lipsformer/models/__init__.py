"""LipsFormer models, registered with timm's factory on import."""
from .lipsformer_cswin import LipsFormerCSwin
from .lipsformer_swin import LipsFormerSwin

__all__ = ['LipsFormerCSwin', 'LipsFormerSwin']
