"""The files of a run folder besides checkpoints and exports: the resolved ``config.yaml``, the ``train.log`` copy of
the package's log records and ``metrics.jsonl``, one JSON line per scored epoch; and the check that every process of a
run (on every node) sees the same run folder."""
import logging
import os
import secrets
import time
from typing import Any

import torch
import yaml
from accelerate.utils import broadcast_object_list

from ..utils.io import JsonLines, write_text
from .config import Config, ConfigError
from .config_io import config_to_dict, dump_config

CONFIG_FILE = 'config.yaml'
LOG_FILE = 'train.log'
METRICS_FILE = 'metrics.jsonl'
_SHARED_CHECK_FILE = '.shared-check'


def check_run_folder_shared(accelerator: Any, run_dir: str) -> None:
    """Refuse a run folder that some processes cannot see (a node-local path on a multi-node run).

    Only the main process writes checkpoints, metrics and exports, and every process writes its RNG state into the
    checkpoint folder and reads the checkpoints back, so all of them need the same folder. The main process writes a
    random token there; every process reads it back. Call it on every process.

    Raises:
        ConfigError: A process does not find the token.
    """
    if accelerator.num_processes == 1:
        return
    token = broadcast_object_list([secrets.token_hex(8) if accelerator.is_main_process else None])[0]
    path = os.path.join(run_dir, _SHARED_CHECK_FILE)
    if accelerator.is_main_process:
        write_text(path, token)
    accelerator.wait_for_everyone()
    try:
        with open(path) as f:
            sees = f.read() == token
    except OSError:
        sees = False
    blind = accelerator.reduce(torch.tensor(float(not sees), device=accelerator.device), reduction='sum').item()
    if accelerator.is_main_process:
        os.remove(path)
    if blind:
        raise ConfigError(
            f'the run folder {os.path.abspath(run_dir)!r} is not shared: {int(blind)} of the '
            f'{accelerator.num_processes} processes do not see what the main process writes there. Give --output a '
            f'folder on a file system every node mounts (checkpoints are written by the main process and read by all)')


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
