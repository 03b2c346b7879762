"""Experiment trackers through Accelerate's ``log_with``: TensorBoard, Weights & Biases and MLflow.

``log.trackers`` chooses them (``all``: every one of the three that is installed; null: TensorBoard when installed).
Each is an optional extra (``pip install 'lipsformer[wandb]'``); one asked for by name and not installed is a
:class:`ConfigError` naming the extra. Everything a tracker writes stays in the run folder unless its own environment
says otherwise: ``tensorboard/<log.project>/`` event files, ``wandb/`` (unless ``WANDB_DIR`` is set) and ``mlruns/``
(an MLflow file store, unless ``MLFLOW_TRACKING_URI`` names a server or a database). The run is named after the run
folder, and a resumed run continues the same wandb and MLflow runs (their ids are kept in ``trackers.json``).
"""
import logging
import os
import secrets
from typing import Any

from accelerate import Accelerator
from accelerate.utils import is_mlflow_available, is_tensorboard_available, is_wandb_available

from ..utils.io import read_json, write_json
from .config import TRACKERS, Config, ConfigError
from .config_io import config_to_dict, flat_dict

__all__ = ['MLFLOW_DIR', 'TENSORBOARD_DIR', 'TRACKER_RUNS_FILE', 'chosen_trackers', 'start_trackers']

MLFLOW_DIR = 'mlruns'
TENSORBOARD_DIR = 'tensorboard'  # Accelerate's logging_dir; TensorBoard writes into <run>/tensorboard/<project>
TRACKER_RUNS_FILE = 'trackers.json'  # the wandb and MLflow run ids, so that a resumed run continues them
_logger = logging.getLogger(__name__)
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


def start_trackers(accelerator: Accelerator, config: Config, run_dir: str) -> None:
    """Start the accelerator's trackers with the config as parameters, continuing this run folder's wandb and MLflow
    runs when it has them (call on every process)."""
    trackers = chosen_trackers(config)
    path = os.path.join(run_dir, TRACKER_RUNS_FILE)
    known = read_json(path) if os.path.isfile(path) else {}
    kwargs = _init_kwargs(trackers, run_dir, known)
    accelerator.init_trackers(config.log.project, init_kwargs=kwargs)
    if not accelerator.is_main_process:
        return
    params = flat_dict(config_to_dict(config))
    for tracker in accelerator.trackers:
        tracker.store_init_configuration(_mlflow_new_params(tracker, params) if tracker.name == 'mlflow' else params)
    if {'wandb', 'mlflow'} & set(trackers):
        runs = dict(known)
        if 'wandb' in trackers:
            runs['wandb'] = {'id': kwargs['wandb']['id']}
        if 'mlflow' in trackers:
            import mlflow
            run_id = accelerator.get_tracker('mlflow', unwrap=True).info.run_id
            runs['mlflow'] = {'run_id': run_id, 'tracking_uri': mlflow.get_tracking_uri()}
        write_json(path, runs)


def _mlflow_new_params(tracker: Any, params: dict[str, Any]) -> dict[str, Any]:
    """The parameters a continued MLflow run has not logged yet: MLflow refuses to change one, so a key changed since
    (e.g. train.epochs, to train longer) keeps its first value there, with a warning; config.yaml has the new one."""
    import mlflow
    logged = mlflow.get_run(tracker.tracker.info.run_id).data.params
    changed = [f'{key} {logged[key]} -> {value}' for key, value in params.items()
               if key in logged and logged[key] != str(value)]
    if changed:
        _logger.warning('MLflow keeps the first value of a parameter; changed since this run started: %s',
                        ', '.join(changed))
    return {key: value for key, value in params.items() if key not in logged}


def _init_kwargs(trackers: list[str], run_dir: str, known: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """``init_kwargs`` of ``Accelerator.init_trackers``: each tracker's files in the run folder, the run's name, and
    the ids of the runs to continue."""
    name = os.path.basename(os.path.normpath(os.path.abspath(run_dir)))
    kwargs: dict[str, dict[str, Any]] = {}
    if 'wandb' in trackers:
        run_id = known.get('wandb', {}).get('id') or secrets.token_hex(4)
        kwargs['wandb'] = {'name': name, 'dir': os.environ.get('WANDB_DIR', run_dir), 'id': run_id,
                           'resume': 'allow'}
    if 'mlflow' in trackers:
        import mlflow
        kwargs['mlflow'] = {'run_name': name}
        if 'MLFLOW_TRACKING_URI' not in os.environ:  # a file store in the run folder: mlflow-skinny writes it
            os.environ.setdefault('MLFLOW_ALLOW_FILE_STORE', 'true')  # MLflow 3 keeps file stores in maintenance
            mlflow.set_tracking_uri('file://' + os.path.join(os.path.abspath(run_dir), MLFLOW_DIR))
        earlier = known.get('mlflow', {})
        if earlier.get('run_id') and earlier.get('tracking_uri') == mlflow.get_tracking_uri():
            kwargs['mlflow']['run_id'] = earlier['run_id']
    return kwargs
