"""Stand-ins that a test hands to a training run: a model that fails or signals on cue, and a Lipschitz constraint
that counts its calls (named in configs as ``probe_models:AlphaCap``)."""
import collections
import os
import signal

import timm
import torch
from timm.models import register_model
from torch import nn

# Training forward calls (counted from 1) whose output the probe model turns into NaN; a subprocess reads them from
# NAN_PROBE_CALLS ("3,9") and, when NAN_PROBE_RANK is set, only that process produces them.
NAN_AT_CALLS: set[int] = {int(c) for c in os.environ.get('NAN_PROBE_CALLS', '').split(',') if c}


# Signals the probe model sends its own process at a forward call: {('train' or 'eval', call): signal}; a subprocess
# reads them from SIGNAL_PROBE ("eval:1:SIGTERM,train:4:SIGINT") and, when SIGNAL_PROBE_RANK is set, only that
# process sends them.
SIGNALS_AT_CALLS: dict[tuple[str, int], signal.Signals] = {
    (mode, int(call)): signal.Signals[name] for mode, call, name in (
        item.split(':') for item in os.environ.get('SIGNAL_PROBE', '').split(',') if item)}


# Forward calls of the probe models of this process so far, by mode.
PROBE_CALLS: collections.Counter = collections.Counter()


def _this_rank(variable: str) -> bool:
    return os.environ.get(variable) in (None, os.environ.get('RANK', '0'))


class NanProbeNet(nn.Module):
    """A tiny convnet that returns NaN logits on the training calls listed in :data:`NAN_AT_CALLS` and signals its
    process at the calls listed in :data:`SIGNALS_AT_CALLS` (both counted per model, from 1)."""

    def __init__(self, num_classes: int = 4, in_chans: int = 1):
        super().__init__()
        self.conv = nn.Conv2d(in_chans, 8, 3, stride=2)
        self.head = nn.Linear(8, num_classes)
        self.calls: collections.Counter = collections.Counter()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.head(self.conv(x).relu().mean((2, 3)))
        mode = 'train' if self.training else 'eval'
        self.calls[mode] += 1
        PROBE_CALLS[mode] += 1
        if mode == 'train' and self.calls[mode] in NAN_AT_CALLS and _this_rank('NAN_PROBE_RANK'):
            logits = logits * float('nan')
        signum = SIGNALS_AT_CALLS.get((mode, self.calls[mode]))
        if signum is not None and _this_rank('SIGNAL_PROBE_RANK'):
            os.kill(os.getpid(), signum)
        return logits


def nan_probe_net(pretrained: bool = False, **kwargs) -> NanProbeNet:
    """timm's entry point of :class:`NanProbeNet` (``model.name=nan_probe_net``)."""
    return NanProbeNet(**{k: v for k, v in kwargs.items() if k in ('num_classes', 'in_chans')})


def register_probe_model() -> str:
    """Register ``nan_probe_net`` with timm (once per process) so that configs can name it; returns the name.

    The tests that train it call this (through the ``probe_model`` fixture in-process, or first thing in a driver
    script run as a subprocess); importing this module registers nothing.
    """
    if not timm.is_model(nan_probe_net.__name__):
        register_model(nan_probe_net)
    return nan_probe_net.__name__


class AlphaCap:
    """A stand-in Lipschitz constraint for the lipschitz.* hook: caps every |alpha| and counts its calls."""

    def __init__(self, model: nn.Module, max_alpha: float):
        self.alphas = [p for name, p in model.named_parameters() if '.alpha' in name and name.endswith('.gamma')]
        self.max_alpha = max_alpha
        self.calls = 0

    def __call__(self) -> None:
        with torch.no_grad():
            for alpha in self.alphas:
                alpha.clamp_(-self.max_alpha, self.max_alpha)
        self.calls += 1

    def state_dict(self) -> dict[str, int]:
        return {'calls': self.calls}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.calls = state['calls']


class PoisonWeights:
    """A stand-in Lipschitz constraint for the lipschitz.* hook that makes every weight infinite after update
    ``at_update`` (counted from 1): an update whose loss was finite leaving weights that are not (``at_update=0``:
    never)."""

    def __init__(self, model: nn.Module, at_update: int):
        self.parameters = list(model.parameters())
        self.at_update = at_update
        self.calls = 0

    def __call__(self) -> None:
        self.calls += 1
        if self.calls == self.at_update:
            with torch.no_grad():
                for parameter in self.parameters:
                    parameter.fill_(float('inf'))
