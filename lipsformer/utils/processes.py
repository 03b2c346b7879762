"""A command's processes from start to end: the device, one process group as launched, and a teardown that cannot
hang. Training (train.py) and evaluation (validate.py) start and end their processes here.

- :func:`select_device`: timm's ``--device`` (``train.device``) prepared before Accelerate starts;
- :func:`set_cudnn_benchmark`: cuDNN's autotuning, on in every command as in timm's scripts, with each command's
  switch to turn it off;
- :func:`wants_cpu_group` / :func:`check_process_group`: the processes a launcher started work together, or not at
  all (below);
- :func:`end_processes`: trackers finished and the process group left without the gloo teardown deadlock;
  :func:`release_accelerator`: Accelerate's per-process settings forgotten, so that another run may use others.

One process group per run, as launched:

torchrun, ``accelerate launch`` and SLURM's ``srun`` tell each process how many were started (``WORLD_SIZE``,
``OMPI_COMM_WORLD_SIZE`` / ``PMI_SIZE`` under mpirun, ``SLURM_STEP_NUM_TASKS``). Accelerate joins them into one group
only on a device it knows how to use for that launch: on a host without an accelerator (no GPU, or one torch cannot
use), every process would otherwise believe it is the only one and run a whole training of its own in the same run
folder. So:

- several processes launched on a host without an accelerator train on the CPU as one group (gloo), as validate.py
  evaluates, and say so;
- a launch that asked for several processes and started one (``accelerate launch --num_processes 2 --cpu``: Accelerate
  1.x starts a single process there, its multi-CPU path needing mpirun) trains alone and says so, with the launch line
  that starts them (:func:`unstarted_processes_note`);
- any other disagreement between the launch and Accelerate's group (``srun -n 8 python train.py``, which no launcher
  joins) is refused with the launch line that works (:class:`LaunchError`, exit 2);
- an Accelerate config that asks for FSDP, on a device where Accelerate does not shard (the CPU), trains with DDP:
  :func:`distributed_summary` says so, in the log and in ``summary.json``.
"""
import gc
import logging
import os
import shlex
import sys
import time
from typing import Any

import torch
from accelerate.state import AcceleratorState, GradientState

__all__ = ['LaunchError', 'check_process_group', 'distributed_summary', 'end_processes', 'launched_processes',
           'unstarted_processes_note',
           'release_accelerator', 'select_device', 'set_cudnn_benchmark', 'wants_cpu_group']

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
    summary: dict[str, Any] = dict(type=kind, processes=accelerator.num_processes,
                                   note=unstarted_processes_note() if accelerator.num_processes == 1 else None)
    if os.environ.get('ACCELERATE_USE_FSDP', 'false').lower() == 'true' and kind != 'FSDP':
        how = 'with DDP: every process holds' if accelerator.num_processes > 1 else 'in one process, which holds'
        summary['note'] = (
            f'the Accelerate config asks for FSDP, but Accelerate shards a model only on GPUs and other accelerators; '
            f'on {accelerator.device.type} this run trains {how} the whole model, its gradients and its optimizer '
            f'state ({kind}). Launch on GPUs to shard, or without the FSDP config to say what runs')
    return summary


def unstarted_processes_note() -> str | None:
    """What to say when a launcher was asked for several processes and started this one alone, else None.

    ``accelerate launch --num_processes N --cpu`` (or a config that says CPU and several processes, without
    ``--multi_gpu``) runs Accelerate's simple launcher: one process, told nothing of N but the rendezvous address it
    sets only for N > 1 (``MASTER_ADDR``, ``MASTER_PORT``) beside ``ACCELERATE_USE_CPU``; the N is read from the
    launcher's command line where it can be.
    """
    if launched_processes()[1] or os.environ.get('RANK') is not None:
        return None  # a launcher that told this process its place in a group
    if os.environ.get('ACCELERATE_USE_CPU') is None or not (os.environ.get('MASTER_ADDR')
                                                             and os.environ.get('MASTER_PORT')):
        return None
    asked = _asked_processes()
    if asked == 1:
        return None
    count = str(asked) if asked else 'N'
    return (f'the launcher was asked for {asked or "several"} processes but started this one alone (accelerate '
            f'launch --cpu starts a single process in Accelerate 1.x): the run trains in one process. To train as '
            f'{count} CPU processes: ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes {count} '
            f'{_command_line()}')


def _asked_processes() -> int | None:
    """The ``--num_processes`` of the ``accelerate launch`` that started this process (Linux's /proc; None when it
    cannot be read there, as from a config file)."""
    try:
        with open(f'/proc/{os.getppid()}/cmdline', 'rb') as f:
            argv = f.read().decode(errors='replace').split('\0')
    except OSError:
        return None
    for index, arg in enumerate(argv):
        value = arg.partition('=')[2] if arg.startswith('--num_processes=') else (
            argv[index + 1] if arg == '--num_processes' and index + 1 < len(argv) else None)
        if value is not None and value.isdigit():
            return int(value)
    return None


def _command_line() -> str:
    """This process's train.py command line, for a launch line to copy (``train.py ...`` when it is not train.py)."""
    argv = sys.argv
    if argv and os.path.basename(argv[0]) in ('train.py', 'lipsformer-train', 'train_command.py'):
        return shlex.join(['train.py' if argv[0].endswith('train_command.py') else argv[0], *argv[1:]])
    return 'train.py ...'


def select_device(device: str | None, option: str = '--device') -> bool:
    """Prepare this process for timm's ``--device`` before Accelerate starts; returns whether it means the CPU.

    None leaves the choice to Accelerate (the accelerator a launch gives each process, else the only one, else the
    CPU); ``cpu`` is the CPU; an accelerator type (``cuda``, ``mps``, ``xpu``, ...) must be the one this host has,
    and with an index (``cuda:1``) it becomes the current device of a single-process run.

    Args:
        device: What the user asked for.
        option: The option or config key that asked, for the messages.

    Raises:
        ValueError: Not a device, not available here, or an index in a launched run (where each process has its own).
    """
    if device is None:
        return False
    try:
        wanted = torch.device(device)
    except RuntimeError as e:
        raise ValueError(f'{option} {device!r} is not a device ({e}); use cpu, cuda, cuda:1, mps, xpu, ...') from None
    if wanted.type == 'cpu':
        return True
    present = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    if present is None or present.type != wanted.type:
        have = f'its accelerator is {present.type}' if present is not None else 'it has no accelerator'
        raise ValueError(f'{option} {device}: this host has no {wanted.type} device ({have}); use cpu'
                         + (f' or {present.type}' if present is not None else ''))
    if wanted.index is not None:
        if int(os.environ.get('WORLD_SIZE', '1')) > 1:
            raise ValueError(f'{option} {device}: a launched run gives each process its own device; give the type '
                             f'alone ({wanted.type}) and choose the devices with the launcher')
        if wanted.index >= torch.accelerator.device_count():
            raise ValueError(f'{option} {device}: there are {torch.accelerator.device_count()} {wanted.type} devices '
                             f'(0 to {torch.accelerator.device_count() - 1})')
        torch.accelerator.set_device_index(wanted.index)
    return False


def set_cudnn_benchmark(enabled: bool, option: str = '--cudnn-benchmark') -> bool:
    """Turn cuDNN's autotuning (``torch.backends.cudnn.benchmark``) on or off for this process; returns ``enabled``
    for the run's records.

    On, cuDNN times its candidate kernels for each new convolution shape and keeps the fastest, as timm's train.py,
    validate.py and benchmark.py ask; off, it takes its heuristic's pick, which for the models' depthwise 7x7
    convolutions is a very slow weight-gradient kernel. Autotuning costs a slower first step for every new input shape,
    and the kernels it picks may differ between runs (timing noise), and with them the last bits of the results: runs
    that must match bit for bit turn it off and ask for deterministic kernels (``torch.backends.cudnn.deterministic``).
    It changes nothing off CUDA.

    Args:
        enabled: Whether cuDNN autotunes.
        option: The option or config key that asked, for the message.

    Raises:
        ValueError: ``enabled`` is not a bool (a string such as ``'false'`` would read as true).
    """
    if not isinstance(enabled, bool):
        raise ValueError(f'{option}: got {enabled!r} ({type(enabled).__name__}); expected true or false')
    torch.backends.cudnn.benchmark = enabled
    return enabled


def end_processes(accelerator: Any) -> None:
    """Finish the trackers and leave the process group, once this process holds nothing prepared by ``accelerator``.

    Call it with the run's models, optimizers and loaders already released by the caller. A DDP wrapper keeps the
    process group alive; when the wrapper holds its last reference, gloo's destructor runs as the wrapper is freed,
    joining its worker threads with the GIL held (torch releases it there only from 2.8). A worker that is still
    dropping a finished collective's tensors needs the GIL to do so: both wait forever, after the run's files are
    written. So the prepared objects go first, then every process agrees that the last collective is done, and the
    GIL is left free a moment for the workers before the group is destroyed.
    """
    accelerator.free_memory()
    gc.collect()
    if accelerator.num_processes > 1:
        accelerator.wait_for_everyone()
        time.sleep(0.1)  # sleeping releases the GIL: gloo's workers drop what they hold
    accelerator.end_training()


def release_accelerator() -> None:
    """Forget Accelerate's per-process settings (precision, plugins) so that another run in this process may use
    other ones; the device and any process group stay as they are."""
    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
