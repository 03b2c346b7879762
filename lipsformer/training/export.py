"""Final weights in timm's format: ``export/<which>/model.safetensors`` (+ ``model_ema.safetensors``) and the
``config.json`` that ``timm.models.save_for_hf`` writes, so that both

    timm.create_model('local-dir:<run>/export/best')
    timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file='<run>/export/best/model.safetensors'))

rebuild the trained network (the second needs the same architecture kwargs as the training config).
"""
import os
import shutil
from typing import Any

import timm
import torch

from ..checkpoint import load_file
from ..utils.io import replace_dir

EXPORT_DIR = 'export'


def export_checkpoint(run_dir: str, which: str, checkpoint_dir: str, model_name: str, model_kwargs: dict[str, Any],
                      data_config: dict[str, Any], class_names: list[str] | None) -> str:
    """Write ``export/<which>`` from a training checkpoint folder, atomically.

    Args:
        run_dir: The run folder.
        which: ``last`` or ``best``.
        checkpoint_dir: The checkpoint whose weights to export.
        model_name: timm model name.
        model_kwargs: The keyword arguments the model was created with (recorded in config.json).
        data_config: input_size / mean / std / interpolation / crop_pct for the pretrained config.
        class_names: Label names in index order, when the dataset has them.

    Returns:
        The export folder.
    """
    with torch.device('meta'):  # no initialisation work: every saved tensor comes from the checkpoint
        model = timm.create_model(model_name, pretrained=False, **model_kwargs)
    model.load_state_dict(load_file(os.path.join(checkpoint_dir, 'model.safetensors')), assign=True)
    final_dir = os.path.join(run_dir, EXPORT_DIR, which)
    tmp_dir = os.path.join(run_dir, EXPORT_DIR, f'.tmp-{which}')
    shutil.rmtree(tmp_dir, ignore_errors=True)
    model_config = {'label_names': class_names} if class_names else None
    timm.models.save_for_hf(model, tmp_dir, model_config=model_config, safe_serialization=True,
                            data_config=data_config)
    ema_path = os.path.join(checkpoint_dir, 'ema.safetensors')
    if os.path.isfile(ema_path):
        shutil.copyfile(ema_path, os.path.join(tmp_dir, 'model_ema.safetensors'))
    replace_dir(tmp_dir, final_dir)
    return final_dir

