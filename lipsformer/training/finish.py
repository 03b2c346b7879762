"""The end of a run: timm-format exports, plots and ``summary.json``."""
import hashlib
import logging
import os
from typing import Any

import torch
from accelerate.utils import gather_object

from ..utils.io import write_json
from .export import export_checkpoint
from .optim import best_metric_name
from .plots import write_plots
from .session import Session
from .train_state import best_checkpoint, is_sharded

_logger = logging.getLogger(__name__)

SUMMARY_FILE = 'summary.json'


def finish_run(session: Session, status: str, wall_time: float) -> dict[str, Any]:
    """Export the weights, draw the plots and write ``summary.json`` (on the main process)."""
    accelerator, config = session.accelerator, session.config
    # With FSDP each process holds a shard, so there is nothing to compare.
    digests = [] if is_sharded(accelerator) else gather_object([_weights_digest(session.unwrapped_model)])
    summary: dict[str, Any] = dict(status=status, epochs_done=session.progress.epoch, step=session.progress.step,
                                   wall_time_s=wall_time, best_metric=best_metric_name(config),
                                   best_value=session.progress.best_value, best_epoch=session.progress.best_epoch,
                                   nonfinite_steps=session.progress.nonfinite_total, rank_weight_sha256=digests,
                                   ranks_identical=len(set(digests)) <= 1, last_checkpoint=session.last_checkpoint)
    if session.progress.history:
        summary['final_metrics'] = session.progress.history[-1]
    if accelerator.is_main_process:
        if status == 'finished' and config.checkpoint.export:
            summary['exports'] = _export(session)
        if config.log.plots:
            summary['plots'] = write_plots(session.progress.history, session.run_dir)
        write_json(os.path.join(session.run_dir, SUMMARY_FILE), summary)
    if not summary['ranks_identical']:
        _logger.error('processes ended with different weights (sha256 %s); DDP synchronisation failed', digests)
    accelerator.wait_for_everyone()
    return summary


def _export(session: Session) -> dict[str, str]:
    exports = {}
    data_config = dict(session.spec.as_dict())
    for which, folder in (('last', session.last_checkpoint), ('best', best_checkpoint(session.run_dir))):
        if folder is None:
            continue
        exports[which] = export_checkpoint(session.run_dir, which, folder, session.config.model.name,
                                           session.model_kwargs, data_config, session.class_names)
        _logger.info('exported %s weights to %s', which, exports[which])
    return exports


def _weights_digest(model: torch.nn.Module) -> str:
    digest = hashlib.sha256()
    for name, tensor in model.state_dict().items():
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
