"""The files of a run folder besides checkpoints and exports: the resolved ``config.yaml``, the ``train.log`` copy of
the package's log records and ``metrics.jsonl``, one JSON line per scored epoch; and the check that every process of a
run (on every node) sees the same run folder."""
import logging
import os
import secrets
import socket
import time
from typing import Any

import yaml
from accelerate.utils import broadcast_object_list, gather_object

from ..utils.io import JsonLines, write_text
from .config import Config, ConfigError
from .config_io import config_to_dict, dump_config

CONFIG_FILE = 'config.yaml'
LOG_FILE = 'train.log'
METRICS_FILE = 'metrics.jsonl'
PLOTS_DIR = 'plots'  # the run's plots, which a model card shows
SUMMARY_FILE = 'summary.json'
EXPORT_DIR = 'export'
_SHARED_CHECK_FILE = '.shared-check'

_logger = logging.getLogger(__name__)


def check_run_folder_shared(accelerator: Any, run_dir: str) -> None:
    """Refuse a run folder that some processes cannot see (a node-local path on a multi-node run).

    Only the main process writes checkpoints, metrics and exports, and every process writes its RNG state into the
    checkpoint folder and reads the checkpoints back, so all of them need the same folder. The main process writes a
    random token there; every process reads it back. Call it on every process. Every process refuses with the same
    message, which names the folder as the main process sees it and the hosts whose processes do not.

    Raises:
        ConfigError: A process does not find the token.
    """
    if accelerator.num_processes == 1:
        return
    token, main_dir, main_host = broadcast_object_list(
        [secrets.token_hex(8), os.path.abspath(run_dir), socket.gethostname()] if accelerator.is_main_process
        else [None, None, None])
    path = os.path.join(run_dir, _SHARED_CHECK_FILE)
    if accelerator.is_main_process:
        write_text(path, token)
    accelerator.wait_for_everyone()
    try:
        with open(path) as f:
            sees = f.read() == token
    except OSError:
        sees = False
    blind = [entry for entry in gather_object([None if sees else (accelerator.process_index, socket.gethostname())])
             if entry is not None]
    if accelerator.is_main_process:
        os.remove(path)
    if blind:
        where = ', '.join(f'{index} on {host}' for index, host in blind)
        raise ConfigError(
            f'the run folder {main_dir!r} (the main process\'s, on {main_host}) is not shared: {len(blind)} of the '
            f'{accelerator.num_processes} processes do not see what the main process writes there (process {where}). '
            f'Give --output a folder on a file system every node mounts (checkpoints are written by the main process '
            f'and read by all)')


def earlier_config_name(step: int) -> str:
    """The name ``config.yaml`` is kept under when a resume at ``step`` changes the config."""
    return f'config.before_step_{step:08d}.yaml'


def write_config(config: Config, run_dir: str, from_step: int = 0, earlier: dict[str, Any] | None = None,
                 resumed: bool = True) -> str | None:
    """Write ``config.yaml``, the config of the steps from ``from_step`` on, and keep the config of the steps before
    as ``config.before_step_<from_step>.yaml`` (with the time appended when that name is taken).

    Args:
        config: The run's config.
        run_dir: The run folder.
        from_step: The step the config applies from (a resume's).
        earlier: The config the steps before ``from_step`` trained with (a resumed checkpoint's, when keys
            changed), for a folder whose ``config.yaml`` does not hold it: a new ``--output`` resumed from another
            run's checkpoint, or an older checkpoint resumed under the current config.
        resumed: Whether the run continues from a checkpoint. A run starting from scratch has no steps before: another
            ``config.yaml`` there is an earlier start's that left no checkpoint, kept as ``config.yaml.orphaned``.

    Returns:
        The file that now holds the config of the steps before ``from_step``, or None when none was kept.
    """
    path = os.path.join(run_dir, CONFIG_FILE)
    current = None
    if os.path.isfile(path):
        with open(path) as f:
            current = yaml.safe_load(f)
    wanted = config_to_dict(config)
    kept = None
    if not resumed:
        if current is not None and current != wanted:
            orphaned = _free_name(f'{path}.orphaned')
            os.rename(path, orphaned)
            _logger.warning('%s: the config of an earlier start that left no checkpoint is kept as %s; this run '
                            'starts from scratch', CONFIG_FILE, os.path.basename(orphaned))
    elif current is not None and current != wanted:
        kept = _free_name(os.path.join(run_dir, earlier_config_name(from_step)))
        os.rename(path, kept)
    elif earlier is not None and earlier != wanted:
        kept = _free_name(os.path.join(run_dir, earlier_config_name(from_step)))
        write_text(kept, yaml.safe_dump(earlier, sort_keys=False, default_flow_style=None))
    if current != wanted:
        dump_config(config, path)
    return kept


def _free_name(path: str) -> str:
    """``path``, or ``path`` with the time before its extension when that name is taken."""
    if not os.path.exists(path):
        return path
    stem, extension = os.path.splitext(path)
    return f'{stem}.{time.strftime("%Y%m%d-%H%M%S")}{extension}'


def linked_run_files(run_dir: str) -> list[str]:
    """The paths a run writes in ``run_dir`` (its files and folders, and the exports in ``export/``) that are symbolic
    links: a write through one would land wherever it points, outside the run folder (an appended ``train.log``, an
    export written into another folder), or replace the link instead of writing through it."""
    from .run_lock import LOCK_FILE
    from .trackers import MLFLOW_DIR, TENSORBOARD_DIR, TRACKER_RUNS_FILE
    from .train_state import CHECKPOINTS_DIR

    names = [CONFIG_FILE, LOG_FILE, METRICS_FILE, f'{METRICS_FILE}.orphaned', SUMMARY_FILE, LOCK_FILE, EXPORT_DIR,
             os.path.join(EXPORT_DIR, 'best'), os.path.join(EXPORT_DIR, 'last'), CHECKPOINTS_DIR, PLOTS_DIR,
             TRACKER_RUNS_FILE, TENSORBOARD_DIR, MLFLOW_DIR, 'wandb']
    return [os.path.join(run_dir, name) for name in names if os.path.islink(os.path.join(run_dir, name))]


def refuse_linked_run_files(run_dir: str) -> None:
    """Refuse a run folder where a file or folder the run writes is a symbolic link (:func:`linked_run_files`).

    Raises:
        ConfigError: Naming each link and where it points, and what to do.
    """
    links = linked_run_files(run_dir)
    if links:
        shown = ', '.join(f'{link} -> {os.readlink(link)}' for link in links)
        one = len(links) == 1
        raise ConfigError(f'--output {run_dir!r}: {shown} {"is a symbolic link" if one else "are symbolic links"}, '
                          f'and a run writes its files only inside its folder, never through a link out of it. Remove '
                          f'{"the link" if one else "the links"} (copying what {"it points" if one else "they point"} '
                          f'to into the folder, to keep it), or choose another --output')


def attach_log_file(run_dir: str, is_main: bool) -> logging.Handler | None:
    """Copy the package's log records into ``<run>/train.log`` (main process); returns the handler to remove.

    This is where a run starts writing into its folder, so every process first refuses a folder whose run files are
    symbolic links (:func:`refuse_linked_run_files`), the log's among them.

    Raises:
        ConfigError: A file or folder the run writes is a symbolic link.
    """
    refuse_linked_run_files(run_dir)
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

    def reset(self, history: list[dict[str, Any]], resumed: bool = True) -> None:
        """Make the file hold exactly ``history`` (the epochs of the checkpoint a run resumes from).

        Lines for epochs past the checkpoint (scored by a start that went further, or by the branch an older
        checkpoint's resume abandons; every line, for a run that starts from scratch: ``resumed`` False) are appended
        to ``metrics.jsonl.orphaned``, and the log says so.
        """
        existing = self.lines.read()
        if len(existing) > len(history):
            orphaned = existing[len(history):]
            JsonLines(self.orphaned_path).append(orphaned)
            epochs = ', '.join(str(line.get('epoch', '?')) for line in orphaned)
            if resumed:
                _logger.warning('%s: %d line(s) past the checkpoint resumed from (epoch %s) are moved to %s; the file '
                                'keeps the epochs of the run continued from there', os.path.basename(self.lines.path),
                                len(orphaned), epochs, os.path.basename(self.orphaned_path))
            else:
                _logger.warning('%s: %d line(s) of an earlier start that left no checkpoint (epoch %s) are moved to '
                                '%s; this run starts from scratch', os.path.basename(self.lines.path), len(orphaned),
                                epochs, os.path.basename(self.orphaned_path))
        self.lines.rewrite(history)

    @property
    def orphaned_path(self) -> str:
        """Where the lines of epochs past a resumed checkpoint are kept."""
        return f'{self.lines.path}.orphaned'

    def append(self, line: dict[str, Any]) -> None:
        self.lines.append([line])
