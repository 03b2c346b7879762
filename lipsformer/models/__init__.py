"""LipsFormer models, registered with timm's factory on import.

:class:`CheckpointError` is what the models raise about a checkpoint (its blocks per stage differ from the model's,
its file cannot be read), :class:`ModelSourceError` (one) that pretrained weights cannot be had from where they were
asked for; :mod:`lipsformer.weights.weight_files` and :mod:`lipsformer.weights.model_names` raise the same classes.
"""
from ._pretrained import ModelSourceError
from ._weights_reading import CheckpointError
from .lipsformer_cswin import LipsFormerCSwin
from .lipsformer_swin import LipsFormerSwin

__all__ = ['CheckpointError', 'LipsFormerCSwin', 'LipsFormerSwin', 'ModelSourceError']
