"""Training LipsFormer (and any timm model) with the paper's no-warmup recipe on Accelerate.

``python train.py --config configs/lipsformer_cswin_tiny.yaml --data-dir /data/imagenet --output runs/x`` is the
command-line front; :func:`train` with a :class:`Config` from :func:`load_config` is the same from Python.

- :mod:`.train_command`: the command line (train.py, ``lipsformer-train``): options, timm train.py's flags as aliases of
  config keys, overrides in any order, exit codes;
- :mod:`.config`: every config key with its type, default, documentation and allowed values; :mod:`.config_io` reads
  YAML (``base:`` files, ``key.sub=value`` overrides), checks it and writes it (and ``configs/reference.yaml``);
- :mod:`.data`: a run's splits opened from its config (through :mod:`lipsformer.data`), transforms, the samplers that
  make resuming exact, batches on the device;
- :mod:`.optim`: optimizer, schedule, losses, mixup and EMA from timm, with the paper's batch-size scaling;
- :mod:`.session`: everything a run holds (accelerator, model, EMA, optimizer, data, Lipschitz constraint), built in
  the order Accelerate needs;
- :mod:`.loop`: one training epoch and one evaluation pass; :mod:`.signals`: graceful stop on SIGTERM / SIGINT;
- :mod:`.train_state`: resumable checkpoints with RNG and distributed states, the newest and the best of a run;
- :mod:`.trackers`: TensorBoard, wandb and MLflow through Accelerate (``log.trackers``);
- :mod:`.run_files`: a run folder's ``config.yaml``, ``train.log`` and ``metrics.jsonl``; :mod:`.run_lock`: one run
  at a time in a run folder;
- :mod:`.trainer`: :func:`train`, a run from its start or a checkpoint to its end; :mod:`.finish`: timm-format exports,
  plots and ``summary.json``;
- :mod:`.overhead`: what the loop costs on top of the model (``python -m lipsformer.training.overhead``).

The device, the process group and the teardown are :mod:`lipsformer.utils.processes`, shared with validate.py.
"""
from ..data import DatasetError, DatasetNotFoundError
from .config import Config, ConfigError
from .config_io import config_to_dict, config_to_yaml, load_config, reference_yaml
from .loop import NonFiniteLossError
from .train_state import latest_checkpoint
from .trainer import train

__all__ = ['Config', 'ConfigError', 'DatasetError', 'DatasetNotFoundError', 'NonFiniteLossError', 'config_to_dict',
           'config_to_yaml', 'latest_checkpoint', 'load_config', 'reference_yaml', 'train']
