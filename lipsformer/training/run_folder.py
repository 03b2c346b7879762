"""Files of a run folder besides checkpoints: the resolved config and the log file."""
import logging
import os
import time

import yaml

from .config import Config
from .config_io import config_to_dict, dump_config


def write_config(config: Config, run_dir: str) -> None:
    """Write ``config.yaml``; an earlier, different one is kept as ``config.<time>.yaml``."""
    path = os.path.join(run_dir, 'config.yaml')
    if os.path.isfile(path):
        with open(path) as f:
            if yaml.safe_load(f) == config_to_dict(config):
                return
        os.rename(path, os.path.join(run_dir, f'config.{time.strftime("%Y%m%d-%H%M%S")}.yaml'))
    dump_config(config, path)


def attach_log_file(run_dir: str, is_main: bool) -> logging.Handler | None:
    """Copy the package's log records into ``<run>/train.log`` (main process); returns the handler to remove."""
    if not is_main:
        return None
    handler = logging.FileHandler(os.path.join(run_dir, 'train.log'))
    handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
    logging.getLogger('lipsformer').addHandler(handler)
    return handler

