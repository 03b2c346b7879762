"""LipsFormer models, registered with timm's factory on import; timm model files on torch and timm alone.

- ``_base``: the trunk both families share (block, stage, the timm model interface, the builder);
- ``lipsformer_swin``, ``lipsformer_cswin``: the families, their checkpoint filters, configs and entry points.

:class:`CheckpointError` is what the models raise about a checkpoint that does not fit them (its blocks per stage);
the package's readers of weight files (:mod:`lipsformer.weights`) raise the same class, and their
``ModelSourceError`` is one. How pretrained weights are read and their failures explained is given to the builder by
``import lipsformer`` (:func:`set_pretrained_loading`): the models know no file format.
"""
from ._base import CheckpointError, set_pretrained_loading
from .lipsformer_cswin import LipsFormerCSwin
from .lipsformer_swin import LipsFormerSwin

__all__ = ['CheckpointError', 'LipsFormerCSwin', 'LipsFormerSwin', 'set_pretrained_loading']
