"""Per-epoch metrics: the ``metrics.jsonl`` file and alpha statistics (the paper's Figure 5)."""
import os
import re
from collections import defaultdict
from typing import Any

import torch

from ..utils.io import JsonLines

METRICS_FILE = 'metrics.jsonl'

# The weighted-residual scales: alpha1 / alpha2 of attention and MLP, conv_shortcuts.N.alpha of the conv branches.
_ALPHA_PARAM = re.compile(r'(?:^|\.)alpha\d*\.gamma$')
_STAGE = re.compile(r'(?:^|\.)(?:layers|stages)\.(\d+)\.')


def alpha_statistics(model: torch.nn.Module) -> dict[str, float]:
    """Mean and standard deviation of every alpha entry per stage, as ``alpha/stage<i>/mean`` and ``.../std``.

    Models without alpha parameters give an empty dict.
    """
    per_stage: dict[str, list[torch.Tensor]] = defaultdict(list)
    for name, param in model.named_parameters():
        if _ALPHA_PARAM.search(name):
            match = _STAGE.search(name)
            per_stage[f'stage{match.group(1)}' if match else 'other'].append(param.detach().float().flatten())
    stats = {}
    for stage, values in sorted(per_stage.items()):
        flat = torch.cat(values)
        if flat.numel() == 0:  # a shard without this stage's alphas (FSDP)
            continue
        stats[f'alpha/{stage}/mean'] = flat.mean().item()
        stats[f'alpha/{stage}/std'] = flat.std().item() if flat.numel() > 1 else 0.0
    return stats


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
