"""Per-epoch metrics: the ``metrics.jsonl`` file, alpha statistics (the paper's Figure 5) and memory."""
import json
import os
import re
import resource
import sys
from collections import defaultdict
from typing import Any

import torch

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


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by this process (or its peak resident memory on a CPU), in MiB."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 20 if sys.platform == 'darwin' else peak / 2 ** 10


class MetricsFile:
    """``<run>/metrics.jsonl``: one JSON object per finished epoch, appended and flushed as each epoch ends."""

    def __init__(self, run_dir: str):
        self.path = os.path.join(run_dir, METRICS_FILE)

    def reset(self, history: list[dict[str, Any]]) -> None:
        """Make the file hold exactly ``history`` (the epochs of the checkpoint a run resumes from).

        Lines for epochs past the checkpoint, written before an interruption, are kept in a ``.orphaned`` file.
        """
        existing = self.read()
        if len(existing) > len(history):
            with open(f'{self.path}.orphaned', 'a') as f:
                f.writelines(json.dumps(line) + '\n' for line in existing[len(history):])
        tmp_path = f'{self.path}.tmp-{os.getpid()}'
        with open(tmp_path, 'w') as f:
            f.writelines(json.dumps(line) + '\n' for line in history)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_path, self.path)

    def append(self, line: dict[str, Any]) -> None:
        with open(self.path, 'a') as f:
            f.write(json.dumps(line) + '\n')
            f.flush()
            os.fsync(f.fileno())

    def read(self) -> list[dict[str, Any]]:
        if not os.path.isfile(self.path):
            return []
        with open(self.path) as f:
            return [json.loads(line) for line in f if line.strip()]
