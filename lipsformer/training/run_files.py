"""The files of a run folder besides checkpoints and exports: the resolved ``config.yaml``, the ``train.log`` copy of
the package's log records and ``metrics.jsonl``, one JSON line per finished epoch."""
import logging
import os
import time
from typing import Any

import yaml

from ..utils.io import JsonLines
from .config import Config
from .config_io import config_to_dict, dump_config

CONFIG_FILE = 'config.yaml'
LOG_FILE = 'train.log'
METRICS_FILE = 'metrics.jsonl'


def write_config(config: Config, run_dir: str) -> None:
    """Write ``config.yaml``; an earlier, different one is kept as ``config.<time>.yaml``."""
    path = os.path.join(run_dir, CONFIG_FILE)
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
    handler = logging.FileHandler(os.path.join(run_dir, LOG_FILE))
    handler.setFormatter(logging.Formatter('%(asctime)s %(levelname)s %(name)s: %(message)s'))
    logging.getLogger('lipsformer').addHandler(handler)
    return handler


class MetricsFile:
    """``<run>/metrics.jsonl``: one JSON object per finished epoch, appended and flushed as each epoch ends."""

    def __init__(self, run_dir: str):
        self.lines = JsonLines(os.path.join(run_dir, METRICS_FILE))

    def reset(self, history: list[dict[str, Any]]) -> None:
        """Make the file hold exactly ``history`` (the epochs of the checkpoint a run resumes from).

        Lines for epochs past the checkpoint, written before an interruption, are kept in a ``.orphaned`` file.
        """
        existing = self.lines.read()
        if len(existing) > len(history):
            JsonLines(f'{self.lines.path}.orphaned').append(existing[len(history):])
        self.lines.rewrite(history)

    def append(self, line: dict[str, Any]) -> None:
        self.lines.append([line])
