"""Training LipsFormer (and any timm model) with the paper's no-warmup recipe on Accelerate.

``python train.py --config configs/lipsformer_cswin_tiny.yaml --data-dir /data/imagenet --output runs/x`` is the
command-line front; :func:`train` with a :class:`Config` from :func:`load_config` is the same from Python.
"""
from .config import Config, ConfigError
from .config_io import config_to_dict, load_config, reference_yaml
from .data import DatasetNotFoundError
from .loop import NonFiniteLossError
from .train_state import latest_checkpoint
from .trainer import train

__all__ = ['Config', 'ConfigError', 'DatasetNotFoundError', 'NonFiniteLossError', 'config_to_dict', 'latest_checkpoint',
           'load_config', 'reference_yaml', 'train']
