"""Two processes on the CPU (gloo) as launchers start them: identical weights on both ranks, global metrics,
checkpoints written once, resume on two processes, a NaN on one rank skipped by both without a hang, a SIGTERM that
only one rank receives stopping both at the same point, the dataset opened by the main process first, and a run folder
that one process cannot see refused.

``accelerate launch --cpu --num_processes 2`` starts a single process in Accelerate 1.x (its multi-CPU path goes
through mpirun); ``ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes 2`` starts two gloo processes
through torchrun. Launched without ``ACCELERATE_USE_CPU`` on a host without a GPU (plain ``torchrun``, or the packaged
FSDP config), Accelerate would leave each process alone; train.py joins them into one CPU group, and the FSDP config
says that it trains with DDP there.
"""
import json
import logging
import os
import subprocess
import sys
import types

import pytest
import torch
from process_support import free_port, subprocess_env
from safetensors.torch import load_file
from training_support import tiny_overrides

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VAL_IMAGES = 24
UPDATES_PER_EPOCH = 3  # 48 training images, 2 processes x batch 8

# Runs train.py's main() after registering the probe model with timm (probe_models.register_probe_model). With
# ELSEWHERE set, process 1 writes into another run folder (as a node that does not mount the run folder would); with
# OPEN_LOG set, each process appends when it opened a dataset (start and end times) to OPEN_LOG<rank>, the main
# process taking half a second over it.
_DRIVER = '''
import os, runpy, sys, time
import probe_models
probe_models.register_probe_model()
import lipsformer.data.sources as data
rank = os.environ['RANK']
if os.environ.get('ELSEWHERE') and rank == '1':
    sys.argv[sys.argv.index('--output') + 1] += '-elsewhere'
if os.environ.get('OPEN_LOG'):
    create = data.create_dataset
    def logged(*args, **kwargs):
        start = time.time()
        time.sleep(0.5 if rank == '0' else 0)
        dataset = create(*args, **kwargs)
        with open(os.environ['OPEN_LOG'] + rank, 'a') as f:
            f.write(f'{start} {time.time()}\\n')
        return dataset
    data.create_dataset = logged
sys.argv = ['train.py'] + sys.argv[1:]
runpy.run_path('train.py', run_name='__main__')
'''


FSDP_CONFIG = os.path.join(REPO, 'configs', 'accelerate', 'fsdp.yaml')
# How each launcher starts two processes on this CPU-only host: the command before the script, and the environment.
LAUNCHERS = {
    'accelerate': (['-m', 'accelerate.commands.launch', '--multi_gpu', '--num_processes', '2', '--num_machines', '1',
                    '--mixed_precision', 'no', '--dynamo_backend', 'no'], {'ACCELERATE_USE_CPU': '1'}),
    'fsdp-config': (['-m', 'accelerate.commands.launch', '--config_file', FSDP_CONFIG, '--num_processes', '2',
                     '--mixed_precision', 'no', '--dynamo_backend', 'no'], {}),
    'torchrun': (['-m', 'torch.distributed.run', '--nproc_per_node', '2'], {}),
}


def launch(tmp_path, run_dir: str, *args: str, env: dict[str, str] | None = None, check: bool = True,
           launcher: str = 'accelerate') -> subprocess.CompletedProcess:
    driver = tmp_path / 'driver.py'
    driver.write_text(_DRIVER)
    start, launcher_env = LAUNCHERS[launcher]
    port = ['--master_port' if launcher == 'torchrun' else '--main_process_port', str(free_port())]
    command = [sys.executable, *start, *port, str(driver), '--output', run_dir, *args]
    environment = subprocess_env(**launcher_env, **(env or {}))
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=180, env=environment)
    if check:
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return result


@pytest.fixture(scope='module')
def two_process_run(data_dir, tmp_path_factory):
    """The packaged FSDP config launched on this CPU-only host without ACCELERATE_USE_CPU."""
    tmp_path = tmp_path_factory.mktemp('ddp')
    run_dir = str(tmp_path / 'run')
    launch(tmp_path, run_dir, *tiny_overrides(data_dir, **{'checkpoint.keep_last': 5}), launcher='fsdp-config')
    return run_dir


def test_ranks_agree_metrics_are_global_and_checkpoints_are_written_once(two_process_run):
    summary = json.load(open(os.path.join(two_process_run, 'summary.json')))
    assert summary['status'] == 'finished'
    assert len(summary['rank_weight_sha256']) == 2 and summary['ranks_identical']
    lines = [json.loads(line) for line in open(os.path.join(two_process_run, 'metrics.jsonl'))]
    assert [line['step'] for line in lines] == [UPDATES_PER_EPOCH, 2 * UPDATES_PER_EPOCH]
    assert all(line['val_samples'] == VAL_IMAGES for line in lines)  # every image once, over both processes
    checkpoint = os.path.join(two_process_run, 'checkpoints', 'epoch_0001')
    assert sorted(os.listdir(checkpoint)) == ['ema.safetensors', 'meta.json', 'model.safetensors', 'optimizer.pt',
                                              'rng_state_0.pt', 'rng_state_1.pt', 'trainer_state.pt']
    assert json.load(open(os.path.join(checkpoint, 'meta.json')))['geometry']['global_batch_size'] == 16
    assert not [n for n in os.listdir(os.path.join(two_process_run, 'checkpoints')) if n.startswith('.')]


def test_the_fsdp_config_on_the_cpu_trains_as_one_ddp_group_and_says_so(two_process_run):
    """Accelerate shards only on accelerators: on this host the FSDP config trains with DDP, which the log and
    summary.json say (the EMA, which FSDP would refuse, stays on)."""
    distributed = json.load(open(os.path.join(two_process_run, 'summary.json')))['distributed']
    assert distributed['type'] == 'MULTI_CPU' and distributed['processes'] == 2
    assert distributed['note'].startswith('the Accelerate config asks for FSDP, but Accelerate shards a model only on '
                                          'GPUs and other accelerators; on cpu this run trains with DDP')
    log = open(os.path.join(two_process_run, 'train.log')).read()
    assert 'WARNING lipsformer.training.trainer: the Accelerate config asks for FSDP' in log
    assert os.path.isfile(os.path.join(two_process_run, 'checkpoints', 'epoch_0002', 'ema.safetensors'))


def test_resume_on_two_processes_reproduces_the_run(two_process_run, data_dir, tmp_path):
    resumed = str(tmp_path / 'resumed')
    launch(tmp_path, resumed, '--resume', os.path.join(two_process_run, 'checkpoints', 'epoch_0001'),
           *tiny_overrides(data_dir, **{'checkpoint.keep_last': 5}))
    for name in ('model.safetensors', 'ema.safetensors'):
        expected = load_file(os.path.join(two_process_run, 'checkpoints', 'epoch_0002', name))
        actual = load_file(os.path.join(resumed, 'checkpoints', 'epoch_0002', name))
        assert all(torch.equal(expected[k], actual[k]) for k in expected)


def test_a_nan_on_one_rank_is_skipped_by_both(data_dir, tmp_path):
    """Launched by plain torchrun on this CPU-only host: the two processes train as one gloo group."""
    run_dir = str(tmp_path / 'run')
    launch(tmp_path, run_dir, *tiny_overrides(data_dir, **{
        'model.name': 'nan_probe_net', 'model.kwargs': '{}', 'checkpoint.export': False}),
        env={'NAN_PROBE_CALLS': '2', 'NAN_PROBE_RANK': '1'}, launcher='torchrun')
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['nonfinite_steps'] == 1 and summary['ranks_identical']
    assert summary['distributed'] == {'type': 'MULTI_CPU', 'processes': 2, 'note': None}
    assert len(summary['rank_weight_sha256']) == 2
    lines = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    assert [line['epoch'] for line in lines] == [1, 2]  # one run, each epoch once
    log = open(os.path.join(run_dir, 'train.log')).read()
    assert '2 processes train as one group (MULTI_CPU) on cpu' in log


def test_a_sigterm_that_one_rank_receives_during_evaluation_stops_both(data_dir, tmp_path):
    """Only rank 1 is signalled, in its first evaluation batch: both ranks leave the evaluation at the same batch (a
    rank that decided alone would wait forever in the other's collectives); the resumed run scores that epoch first.
    The main process opens the dataset before the other does (a download would happen once)."""
    run_dir = str(tmp_path / 'run')
    overrides = tiny_overrides(data_dir, **{'model.name': 'nan_probe_net', 'model.kwargs': '{}',
                                            'checkpoint.export': False, 'data.download': True})
    launch(tmp_path, run_dir, *overrides, env={'SIGNAL_PROBE': 'eval:1:SIGTERM', 'SIGNAL_PROBE_RANK': '1',
                                               'OPEN_LOG': str(tmp_path / 'opened')})
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    assert summary['status'] == 'stopped' and summary['epochs_done'] == 1 and summary['ranks_identical']
    meta = json.load(open(os.path.join(run_dir, 'checkpoints', 'epoch_0001', 'meta.json')))
    assert meta['progress']['unscored']['epoch'] == 1 and not meta['progress']['history']
    main_opened, other_opened = ([tuple(map(float, line.split())) for line in open(tmp_path / f'opened{rank}')]
                                 for rank in (0, 1))
    assert len(main_opened) == len(other_opened) == 2  # the training and the validation split
    assert min(start for start, _ in other_opened) >= max(end for _, end in main_opened)
    launch(tmp_path, run_dir, '--resume', 'auto', *overrides)
    lines = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    assert [line['epoch'] for line in lines] == [1, 2] and all(line['val_samples'] == VAL_IMAGES for line in lines)


def test_a_run_folder_that_one_process_cannot_see_is_refused(data_dir, tmp_path):
    """Every process refuses; the main process says it once, naming the folder it writes (process 1's own path is
    never made)."""
    result = launch(tmp_path, str(tmp_path / 'run'), *tiny_overrides(data_dir), env={'ELSEWHERE': '1'}, check=False)
    assert result.returncode != 0
    reasons = [line for line in result.stderr.splitlines() if '(exit 2)' in line]
    assert len(reasons) == 1, result.stderr[-3000:]
    for reason in reasons:
        assert f"the run folder '{tmp_path / 'run'}' (the main process's, on " in reason
        assert 'is not shared: 1 of the 2 processes do not see what the main process writes there' in reason
        assert 'elsewhere' not in reason
    assert not os.path.exists(tmp_path / 'run' / 'checkpoints')


def test_tasks_that_slurm_started_without_a_launcher_are_refused_before_the_run_folder(data_dir, tmp_path,
                                                                                      monkeypatch, caplog):
    """`srun -n 4 python train.py`: four tasks, none of which Accelerate joins to the others. Each would train alone
    in the same folder; each is refused with exit 2 and a launch line that works."""
    from lipsformer.training.train_command import main
    monkeypatch.setenv('SLURM_STEP_NUM_TASKS', '4')
    monkeypatch.setenv('SLURM_PROCID', '2')
    with caplog.at_level(logging.ERROR):
        assert main(['--output', str(tmp_path / 'run'), *tiny_overrides(data_dir)]) == 2
    reason = caplog.records[-1].getMessage()
    assert reason.startswith('LaunchError: SLURM_STEP_NUM_TASKS=4: the launcher started 4 processes, but Accelerate '
                             'sees 1 in its group') and 'this is process 2' in reason
    assert 'as scripts/slurm_train.sh does (srun --ntasks-per-node=1 accelerate launch' in reason
    assert not os.path.exists(tmp_path / 'run')


def test_a_launch_accelerate_does_not_join_names_a_launch_line_that_works(monkeypatch):
    from lipsformer.utils.processes import LaunchError, check_process_group
    alone = types.SimpleNamespace(num_processes=1, distributed_type='DistributedType.NO')
    monkeypatch.setenv('WORLD_SIZE', '2')
    monkeypatch.setenv('RANK', '1')
    monkeypatch.setattr(sys, 'argv', ['train.py', '--config', 'quickstart', '--output', 'runs/q'])
    with pytest.raises(LaunchError, match=r'WORLD_SIZE=2: the launcher started 2 processes, but Accelerate sees 1 .*'
                                          r'this is process 1\). They would run separate trainings in one run folder, '
                                          r'so none starts.*on the CPU: ACCELERATE_USE_CPU=1 accelerate launch '
                                          r'--multi_gpu --num_processes 2 train.py --config quickstart '
                                          r'--output runs/q'):
        check_process_group(alone)
    monkeypatch.setenv('WORLD_SIZE', '1')
    check_process_group(alone)
    monkeypatch.delenv('WORLD_SIZE')
    check_process_group(alone)  # no launcher
