"""Experiment trackers through Accelerate's ``log_with``: TensorBoard, Weights & Biases and MLflow.

``log.trackers`` chooses them (``all``: every one of the three that is installed; null: TensorBoard when installed).
Each is an optional extra (``pip install 'lipsformer[wandb]'``); one asked for by name and not installed is a
:class:`ConfigError` naming the extra. Everything a tracker writes stays in the run folder unless its own environment
says otherwise: ``tensorboard/<log.project>/`` event files, ``wandb/`` (unless ``WANDB_DIR`` is set) and ``mlruns/``
(an MLflow file store, unless ``MLFLOW_TRACKING_URI`` names a server or a database). The run is named after the run
folder.
"""
import os
from typing import Any

from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

from .config import TRACKERS, Config, ConfigError

__all__ = ['MLFLOW_DIR', 'TENSORBOARD_DIR', 'tracker_init_kwargs', 'chosen_trackers']

MLFLOW_DIR = 'mlruns'
TENSORBOARD_DIR = 'tensorboard'  # Accelerate's logging_dir; TensorBoard writes into <run>/tensorboard/<project>
_AVAILABLE = {'tensorboard': is_tensorboard_available, 'wandb': is_wandb_available, 'mlflow': is_mlflow_available}


def chosen_trackers(config: Config) -> list[str]:
    """The trackers ``log.trackers`` asks for, each installed.

    Raises:
        ConfigError: A tracker asked for by name is not installed.
    """
    asked = config.log.trackers
    if asked is None:
        return ['tensorboard'] if _AVAILABLE['tensorboard']() else []
    if 'all' in asked:
        return [name for name in TRACKERS if _AVAILABLE[name]()]
    for name in asked:
        if not _AVAILABLE[name]():
            raise ConfigError(f'log.trackers: {name} is not installed; pip install "lipsformer[{name}]" (or '
                              f'remove {name} from log.trackers; log.trackers=[all] uses whichever are installed)')
    return list(dict.fromkeys(asked))


def tracker_init_kwargs(trackers: list[str], run_dir: str) -> dict[str, dict[str, Any]]:
    """``init_kwargs`` of ``Accelerator.init_trackers``: each tracker's files in the run folder, the run's name."""
    name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    kwargs: dict[str, dict[str, Any]] = {}
    if 'wandb' in trackers:
        kwargs['wandb'] = {'name': name, 'dir': os.environ.get('WANDB_DIR', run_dir)}
    if 'mlflow' in trackers:
        kwargs['mlflow'] = {'run_name': name}
        if 'MLFLOW_TRACKING_URI' not in os.environ:  # a file store in the run folder: mlflow-skinny writes it
            import mlflow
            os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')  # MLflow 3 keeps file stores in maintenance
            mlflow.set_tracking_uri('file://' + os.path.join(os.path.abspath(run_dir), MLFLOW_DIR))
    return kwargs
