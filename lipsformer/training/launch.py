"""One process group per run, as launched: the processes a launcher started train together, or not at all.

torchrun, ``accelerate launch`` and SLURM's ``srun`` tell each process how many were started (``WORLD_SIZE``,
``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE`` under mpirun, ``SLURM_STEP_NUM_TASKS``). Accelerate joins them into one group
only on a device it knows how to use for that launch: on a host without an accelerator (no GPU, or one torch cannot
use), every process would otherwise believe it is the only one and run a whole training of its own in the same run
folder. So:

- several processes launched on a host without an accelerator train on the CPU as one group (gloo), as validate.py
  evaluates, and say so;
- any other disagreement between the launch and Accelerate's group (``srun -n 8 python train.py``, which no launcher
  joins) is refused with the launch line that works (:class:`LaunchError`, exit 2);
- an Accelerate config that asks for FSDP, on a device where Accelerate does not shard (the CPU), trains with DDP:
  :func:`distributed_summary` says so, in the log and in ``summary.json``.
"""
import logging
import os
import shlex
import sys
from typing import Any

import torch

__all__ = ['LaunchError', 'check_process_group', 'distributed_summary', 'launched_processes', 'wants_cpu_group']

_logger = logging.getLogger(__name__)

# Variables by which launchers tell each process how many they started, the most specific first.
_WORLD_VARIABLES = ('WORLD_SIZE', 'OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'MV2_COMM_WORLD_SIZE', 'SLURM_STEP_NUM_TASKS')
_TORCH_LAUNCH = ('WORLD_SIZE', 'OMPI_COMM_WORLD_SIZE', 'PMI_SIZE', 'MV2_COMM_WORLD_SIZE')  # what Accelerate reads


class LaunchError(RuntimeError):
    """The processes launched do not form the group Accelerate sees; the message gives a launch line that works."""


def launched_processes() -> tuple[int, str]:
    """How many processes the launcher says it started, and the variable that says so (1, '' when none does)."""
    for name in _WORLD_VARIABLES:
        value = os.environ.get(name, '')
        if value.isdigit() and int(value) > 0:
            return int(value), name
    return 1, ''


def wants_cpu_group() -> bool:
    """Whether this process was launched as one of several by a launcher Accelerate reads, on a host where torch finds
    no accelerator: Accelerate then needs ``cpu=True`` to join the processes into one (gloo) group."""
    count, variable = launched_processes()
    return count > 1 and variable in _TORCH_LAUNCH and not torch.accelerator.is_available()


def check_process_group(accelerator: Any) -> None:
    """Refuse a launch whose processes Accelerate does not see as one group (each would train alone).

    Raises:
        LaunchError: The environment says N processes were started, Accelerate sees another number.
    """
    count, variable = launched_processes()
    if count == accelerator.num_processes or (count == 1 and not variable):
        return
    rank = os.environ.get('RANK') or os.environ.get('SLURM_PROCID') or os.environ.get('OMPI_COMM_WORLD_RANK') or '?'
    command = _command_line()
    if variable == 'SLURM_STEP_NUM_TASKS':
        fix = (f'start one task per node that starts Accelerate, as scripts/slurm_train.sh does (srun '
               f'--ntasks-per-node=1 accelerate launch --multi_gpu --num_machines $SLURM_NNODES --machine_rank '
               f'$SLURM_NODEID --num_processes <GPUs in all> --main_process_ip <first node> {command})')
    else:
        fix = (f'on GPUs, check that torch sees them in every process (python -c "import torch; '
               f'print(torch.cuda.device_count())", CUDA_VISIBLE_DEVICES); on the CPU: ACCELERATE_USE_CPU=1 '
               f'accelerate launch --multi_gpu --num_processes {count} {command}')
    raise LaunchError(
        f'{variable}={count}: the launcher started {count} processes, but Accelerate sees {accelerator.num_processes} '
        f'in its group ({accelerator.distributed_type}; this is process {rank}). They would run separate trainings in '
        f'one run folder, so none starts. To train as one group, {fix}')


def distributed_summary(accelerator: Any) -> dict[str, Any]:
    """How the run is distributed, for ``summary.json``: Accelerate's type, the processes and, when the Accelerate
    config asked for FSDP and the run does not shard, the note that says so (also logged at the start)."""
    kind = str(accelerator.distributed_type).rsplit('.', 1)[-1]
    summary: dict[str, Any] = dict(type=kind, processes=accelerator.num_processes, note=None)
    if os.environ.get('ACCELERATE_USE_FSDP', 'false').lower() == 'true' and kind != 'FSDP':
        how = 'with DDP: every process holds' if accelerator.num_processes > 1 else 'in one process, which holds'
        summary['note'] = (
            f'the Accelerate config asks for FSDP, but Accelerate shards a model only on GPUs and other accelerators; '
            f'on {accelerator.device.type} this run trains {how} the whole model, its gradients and its optimizer '
            f'state ({kind}). Launch on GPUs to shard, or without the FSDP config to say what runs')
    return summary


def _command_line() -> str:
    """This process's train.py command line, for a launch line to copy (``train.py ...`` when it is not train.py)."""
    argv = sys.argv
    if argv and os.path.basename(argv[0]) in ('train.py', 'lipsformer-train', 'train_command.py'):
        return shlex.join(['train.py' if argv[0].endswith('train_command.py') else argv[0], *argv[1:]])
    return 'train.py ...'
