"""Writing a timm model folder (``config.json`` + ``model.safetensors``) that timm and transformers both load.

``timm.models.save_for_hf`` records the class count twice in ``config.json``: at the root (``num_classes``, which timm
reads back as the pretrained cfg's) and among the constructor arguments (``model_args``). transformers' TimmWrapper
(``AutoModelForImageClassification``, ``pipeline('image-classification')``) calls ``timm.create_model(architecture,
num_classes=<the root value>, **model_args)``, which fails on the second copy ("got multiple values for keyword
argument 'num_classes'"). The folders this package writes keep the root one only; timm builds the same model from it.
"""
import os
from typing import Any

import timm
import torch

from ..utils.io import read_json, write_json

__all__ = ['save_model_folder']

TIMM_CONFIG_FILE = 'config.json'


def save_model_folder(model: torch.nn.Module, folder: str, model_config: dict[str, Any] | None = None,
                      data_config: dict[str, Any] | None = None) -> None:
    """``timm.models.save_for_hf(model, folder, safe_serialization=True)``, with ``num_classes`` at the root of
    ``config.json`` only (see the module docstring).

    Args:
        model: The model whose weights and construction arguments are written.
        folder: The folder to write into (created if needed).
        model_config: Extra ``config.json`` entries (``label_names``, ...).
        data_config: The preprocessing the weights were trained or evaluated with (``input_size``, ``mean``, ...).
    """
    timm.models.save_for_hf(model, folder, model_config=model_config, safe_serialization=True,
                            data_config=data_config)
    path = os.path.join(folder, TIMM_CONFIG_FILE)
    config = read_json(path)
    if 'num_classes' in config.get('model_args', {}):
        del config['model_args']['num_classes']
        write_json(path, config)
