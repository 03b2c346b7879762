"""The machine a run or a measurement ran on: CPU name and generation, peak memory and page faults."""
import platform
import resource
import sys
from pathlib import Path

import torch

__all__ = ['cpu_details', 'cpu_name', 'cpuinfo', 'minor_page_faults', 'peak_memory_mb', 'peak_rss_mb']

# /proc/cpuinfo fields that tell CPU generations apart where the model name does not (a cloud guest's "AMD EPYC").
_CPUINFO_FIELDS = {'vendor_id': 'vendor', 'cpu family': 'family', 'model': 'model', 'stepping': 'stepping'}


def cpuinfo() -> dict[str, str]:
    """The fields of Linux's /proc/cpuinfo, each with its first value (the first processor's, where every processor
    lists it); empty where there is no such file."""
    fields: dict[str, str] = {}
    try:
        for line in Path('/proc/cpuinfo').read_text().splitlines():
            key, _, value = line.partition(':')
            fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_name() -> str:
    """The CPU's model name (Linux /proc/cpuinfo), else what ``platform`` knows."""
    return cpuinfo().get('model name') or platform.processor() or platform.machine()


def cpu_details() -> dict[str, str]:
    """The CPU's name, vendor, family, model and stepping (Linux), and the vector instruction set PyTorch's kernels
    use (``torch.backends.cpu.get_cpu_capability()``): what makes speed ratios comparable between machines."""
    info = cpuinfo()
    return ({'name': cpu_name()} | {field: info[key] for key, field in _CPUINFO_FIELDS.items() if key in info}
            | {'isa': torch.backends.cpu.get_cpu_capability()})


def peak_rss_mb() -> float:
    """The most resident memory this process has held so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2 ** 20 if sys.platform == 'darwin' else peak / 2 ** 10  # bytes on macOS, KiB on Linux


def minor_page_faults() -> int:
    """Minor page faults this process has taken so far: pages of fresh memory the kernel mapped in on first touch."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def peak_memory_mb(device: torch.device) -> float:
    """Peak accelerator memory allocated by this process on ``device`` (on a CPU, its peak resident memory), in MiB."""
    if device.type == 'cuda':
        return torch.cuda.max_memory_allocated(device) / 2 ** 20
    return peak_rss_mb()


