"""What a few steps of a model run on the device, from ``torch.profiler``: kernels per step, the device's busy
fraction, the kernels that take the most time and the attention (SDPA) kernels and ops that ran.

Used by ``python -m lipsformer.instruments.benchmark --profile`` (one summary per model and mode, after its timed runs)
and by ``scripts/gpu_check.sh``. :func:`summarize` works on plain :class:`TimedEvent` records, so that it is tested
without a GPU; :func:`profile_steps` turns a profiler's events into them.
"""

import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch

__all__ = ['KERNEL_KINDS', 'TimedEvent', 'busy_time', 'kernel_kind', 'profile_steps', 'summarize']

# Host-side ops of the attention kernels (their names say which kernel: flash, memory-efficient, cuDNN, math's parts).
SDPA_OP = re.compile(
    r'^aten::_(scaled_dot_product_\w+|flash_attention_\w+|efficient_attention_\w+|cudnn_attention\w*)$')
# Device kernels of attention: FlashAttention's, CUTLASS's memory-efficient FMHA, cuDNN's SDPA engines.
SDPA_KERNEL = re.compile(r'flash|fmha|attention|sdpa|cudnn_generated_fort_native_sdpa', re.IGNORECASE)


# Kinds of device kernels, by name, in the order they are tried: the profiler's own ranges on the device timeline
# (an optimizer step's, which overlap its kernels); attention; convolutions (cuDNN's, PyTorch's own
# depthwise kernels); matrix products (cuBLAS, CUTLASS, cuBLASLt's
# nvjet); the fused kernels inductor generates (triton_poi_/red_/per_...); copies, fills and layout changes; the rest
# (elementwise ops, reductions, norms, the package's other Triton kernels).
KERNEL_KINDS = (
    ('annotation', re.compile(r'^(Optimizer\.|ProfilerStep)')),
    ('attention', SDPA_KERNEL),
    ('convolution', re.compile(r'conv|dgrad|wgrad|depthwise', re.IGNORECASE)),
    ('matmul', re.compile(r'gemm|cublas|cutlass|nvjet|xmma|wgmma|matmul|splitK', re.IGNORECASE)),
    ('inductor fused', re.compile(r'^triton_(poi|red|per|tem|for)_')),
    ('copy', re.compile(r'copy|memcpy|memset|fill|transpose|cat_|CatArray', re.IGNORECASE)),
)


def kernel_kind(name: str) -> str:
    """The kind of a device kernel by its name (:data:`KERNEL_KINDS`), else 'other'."""
    return next((kind for kind, pattern in KERNEL_KINDS if pattern.search(name)), 'other')


@dataclass(frozen=True)
class TimedEvent:
    """One profiled event: its name, start and end in microseconds, and whether it ran on the device (a kernel,
    a copy or a memset) or on the host (an op, a runtime call)."""

    name: str
    start_us: float
    end_us: float
    on_device: bool


def busy_time(events: Iterable[TimedEvent]) -> float:
    """Microseconds covered by at least one of ``events`` (overlapping kernels counted once)."""
    total, end = 0.0, float('-inf')
    for event in sorted(events, key=lambda event: event.start_us):
        if event.end_us <= end:
            continue
        total += event.end_us - max(event.start_us, end)
        end = event.end_us
    return total


def summarize(events: list[TimedEvent], steps: int, step_ms: float | None = None, top: int = 10) -> dict[str, Any]:
    """Per-step figures of ``steps`` profiled steps.

    Args:
        events: the profiled events of the steps.
        steps: how many steps the events cover.
        step_ms: the step's time measured without the profiler (its overhead slows the host), for the busy fraction
            of a real step; the profiled window is used as well.
        top: kernels to list, by their total time.

    Returns:
        ``kernels_per_step`` (device events), ``device_busy_ms_per_step`` (the union of their intervals),
        ``busy_fraction_of_profiled_window`` and ``busy_fraction_of_timed_step`` (None without ``step_ms``),
        ``top_kernels`` (name, calls and ms per step, share of the device's busy time), ``ms_per_step_by_kind``
        (kernel time by :func:`kernel_kind`), ``sdpa_ops`` and ``sdpa_kernels`` (names of the attention ops and
        kernels that ran).
    """
    if steps < 1:
        raise ValueError(f'steps must be at least 1, got {steps}')
    device = [event for event in events if event.on_device]
    window_us = (max(event.end_us for event in events) - min(event.start_us for event in events)) if events else 0.0
    busy_us = busy_time(device)
    totals: dict[str, list[float]] = {}
    for event in device:
        calls_and_time = totals.setdefault(event.name, [0, 0.0])
        calls_and_time[0] += 1
        calls_and_time[1] += event.end_us - event.start_us
    kernel_us = sum(time_us for _, time_us in totals.values())
    by_kind = dict.fromkeys([kind for kind, _ in KERNEL_KINDS] + ['other'], 0.0)
    for name, (_, time_us) in totals.items():
        by_kind[kernel_kind(name)] += time_us / steps / 1e3
    ranked = sorted(totals.items(), key=lambda item: -item[1][1])[:top]
    return {
        'steps': steps,
        'kernels_per_step': len(device) / steps,
        'device_busy_ms_per_step': busy_us / steps / 1e3,
        'profiled_window_ms_per_step': window_us / steps / 1e3,
        'busy_fraction_of_profiled_window': busy_us / window_us if window_us else None,
        'timed_step_ms': step_ms,
        'busy_fraction_of_timed_step': busy_us / steps / 1e3 / step_ms if step_ms else None,
        'top_kernels': [{'name': name, 'calls_per_step': calls / steps, 'ms_per_step': time_us / steps / 1e3,
                         'share': time_us / kernel_us if kernel_us else None}
                        for name, (calls, time_us) in ranked],
        'ms_per_step_by_kind': by_kind,
        'sdpa_ops': sorted({event.name for event in events if not event.on_device and SDPA_OP.match(event.name)}),
        'sdpa_kernels': sorted({event.name for event in device if SDPA_KERNEL.search(event.name)}),
    }


def profile_steps(step: Callable[[], Any], steps: int = 3, device: str = 'cpu',
                  step_ms: float | None = None) -> dict[str, Any]:
    """Run ``step`` ``steps`` times under ``torch.profiler`` (the CUDA activity too on a CUDA device) and
    :func:`summarize` the events. The step should be warm (compiled, allocator and optimizer state ready)."""
    cuda = torch.device(device).type == 'cuda'
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    if cuda:
        torch.cuda.synchronize(device)
    with torch.profiler.profile(activities=activities) as profiler:
        for _ in range(steps):
            step()
        if cuda:
            torch.cuda.synchronize(device)
    events = [TimedEvent(event.name, event.time_range.start, event.time_range.end,
                         event.device_type != torch.autograd.DeviceType.CPU)
              for event in profiler.events()]
    return summarize(events, steps, step_ms)
