"""Helpers every part of the package shares, as timm keeps ``timm/utils/``.

- :mod:`.io`: writes that survive a crash at any instant (text, JSON, torch and safetensors files, whole folders),
  the clean-up of what a killed writer left, and JSON-lines logs;
- :mod:`.env`: the machine a run or a measurement ran on (CPU name and generation, peak memory, page faults);
- :mod:`.processes`: a command's processes from start to end (the device ``--device`` asks for, one process group as
  launched, a teardown that cannot hang), shared by training and evaluation;
- :mod:`.cli`: what the command lines share (the command's name as it was run, help with real defaults).
"""
from .cli import HelpFormatter, command_name
from .env import cpu_details, cpu_name, cpuinfo, minor_page_faults, peak_memory_mb, peak_rss_mb
from .io import (
    JsonLines,
    atomic_open,
    atomic_path,
    fsync_dir,
    read_json,
    remove_dir,
    remove_stale_temporaries,
    replace_dir,
    save_safetensors,
    save_torch,
    write_json,
    write_text,
)
from .processes import end_processes, select_device

__all__ = ['HelpFormatter', 'JsonLines', 'atomic_open', 'atomic_path', 'command_name', 'cpu_details', 'cpu_name',
           'cpuinfo', 'end_processes', 'fsync_dir', 'minor_page_faults', 'peak_memory_mb', 'peak_rss_mb', 'read_json',
           'remove_dir', 'remove_stale_temporaries', 'replace_dir', 'save_safetensors', 'save_torch', 'select_device',
           'write_json', 'write_text']
