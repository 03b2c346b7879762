"""Compiled training on the CPU (inductor), end to end with the tiny configs: ``model.compile``, its scopes (regional
by default, whole) and modes, EMA, gradient accumulation, clipping and the Lipschitz constraint under compile, the
first step's compile time in the log and ``summary.json``, plain weight names, exports, and resuming compiled from eager
and eager from compiled.

Compiling costs tens of seconds a graph on a small CPU, so the runs are shared between the tests (module fixtures).
"""
import json
import math
import os
import shutil
import signal
import time
from types import SimpleNamespace

import pytest
import timm
import torch
from process_support import single_thread
from safetensors.torch import load_file, save_file
from training_support import tiny_overrides

import lipsformer.training.session as session_module
import lipsformer.training.trainer as trainer
from lipsformer.training import compilation, load_config, train
from lipsformer.training.compilation import compiles, dynamo_plugin, effective_mode, keep_own_gradients
from lipsformer.training.loop import EpochResult, EpochTally, _record_compile_time
from lipsformer.training.train_state import Progress, optimizer_state_dict, set_optimizer_state
from lipsformer.utils.io import file_sha256
from lipsformer.weights.weight_files import strip_wrapper_prefixes

# Two updates of two micro-batches an epoch (48 images, batch 8, 6 micro-batches: 3 updates), clipping and the
# package's Lipschitz constraint, EMA (tiny_overrides turns it on); the validation split (24 images, batches of 16)
# ends in a partial batch.
# No stochastic depth: compiled code draws its random numbers otherwise than eager (tests/test_compile.py checks
# the compiled drop path's statistics).
SETTINGS = {'train.grad_accum_steps': 2, 'optimizer.clip_grad': 1.0, 'lipschitz.enabled': True,
            'lipschitz.kwargs': '{weight_cap: 2.0}', 'checkpoint.keep_last': 5, 'model.drop_path_rate': 0.0}
UPDATES_PER_EPOCH = 3
# Compiled and eager kernels sum in other orders; a few Adam updates keep the weights this close (relative norm).
WEIGHTS_TOLERANCE = 1e-3


def _overrides(data_dir: str, **extra: object) -> list[str]:
    return tiny_overrides(data_dir, **{**SETTINGS, **extra})


def _train(data_dir: str, run_dir: str, resume: str | None = None, **extra: object) -> dict:
    with single_thread():
        return train(load_config(None, _overrides(data_dir, **extra)), run_dir, resume=resume)


def _weights(run_dir: str, checkpoint: str, name: str = 'model.safetensors') -> dict[str, torch.Tensor]:
    return load_file(os.path.join(run_dir, 'checkpoints', checkpoint, name))


def _assert_close_weights(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert actual.keys() == expected.keys()
    errors = {k: ((actual[k] - expected[k]).norm() / expected[k].norm().clamp(min=1e-12)).item() for k in expected}
    worst = max(errors, key=errors.get)
    assert errors[worst] < WEIGHTS_TOLERANCE, f'{worst}: relative difference {errors[worst]:.2e}'


@pytest.fixture(scope='module')
def runs(data_dir, tmp_path_factory):
    """A compiled run and the same run eager, two epochs each."""
    root = tmp_path_factory.mktemp('compile')
    torch._dynamo.reset()
    compiled = _train(data_dir, str(root / 'compiled'), **{'model.compile': True})
    eager = _train(data_dir, str(root / 'eager'), **{'model.compile': False})
    return root, compiled, eager


def test_auto_compiles_on_cuda_and_not_on_the_cpu(monkeypatch):
    config = load_config(None, [])
    assert config.model.compile == 'auto' and config.model.compile_mode == 'default'
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: True)
    assert compiles(config, cpu=False) and not compiles(config, cpu=True)
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    assert not compiles(config, cpu=False)
    assert compiles(load_config(None, ['model.compile=true']), cpu=True)
    assert not compiles(load_config(None, ['model.compile=false']), cpu=False)


def test_compiled_run_trains_as_eager_logs_its_compile_time_and_saves_plain_weights(runs):
    root, compiled, eager = runs
    assert compiled['status'] == eager['status'] == 'finished'
    assert compiled['step'] == 2 * UPDATES_PER_EPOCH and compiled['nonfinite_steps'] == 0
    assert compiled['compile']['scope'] == 'regional' and compiled['compile']['first_step_s'] > 0
    assert compiled['compile']['mode'] == compiled['compile']['requested_mode'] == 'default'
    assert eager['compile'] is None
    assert json.load(open(root / 'compiled' / 'summary.json'))['compile'] == compiled['compile']
    log = open(root / 'compiled' / 'train.log').read()
    assert 'the model is compiled with inductor, scope regional, mode default' in log
    assert 'compiled the training step (scope regional, mode default)' in log
    speeds = [json.loads(line)['images_per_s'] for line in open(root / 'compiled' / 'metrics.jsonl')]
    assert speeds[0] > speeds[1] / 10  # the first epoch's speed leaves out the step that compiled (tens of seconds)
    for name in ('model.safetensors', 'ema.safetensors'):  # EMA, accumulation, clipping, constraint: as eager
        compiled_weights = _weights(str(root / 'compiled'), 'epoch_0002', name)
        eager_weights = _weights(str(root / 'eager'), 'epoch_0002', name)
        assert not [key for key in compiled_weights if '_orig_mod' in key]
        _assert_close_weights(compiled_weights, eager_weights)
    trainer_state = torch.load(root / 'compiled' / 'checkpoints' / 'epoch_0002' / 'trainer_state.pt')
    assert 'lipschitz' in trainer_state['extra']  # the constraint ran (and saved its power-iteration vectors)
    exported = timm.create_model(f'local-dir:{root / "compiled" / "export" / "last"}', pretrained=True)
    final = _weights(str(root / 'compiled'), 'epoch_0002')
    assert all(torch.equal(tensor, final[name]) for name, tensor in exported.state_dict().items())
    scores = [json.loads(line) for line in open(root / 'compiled' / 'metrics.jsonl')]
    assert [line['val_samples'] for line in scores] == [24, 24]


def test_a_compiled_run_resumes_eager_and_an_eager_run_resumes_compiled(runs, data_dir):
    root, _, _ = runs
    for source, target, compile_now in (('compiled', 'eager_from_compiled', False),
                                        ('eager', 'compiled_from_eager', True)):
        summary = _train(data_dir, str(root / target), resume=str(root / source / 'checkpoints' / 'epoch_0001'),
                         **{'model.compile': compile_now, 'model.grad_checkpointing': compile_now})
        assert summary['status'] == 'finished' and summary['step'] == 2 * UPDATES_PER_EPOCH
        assert (summary['compile'] is not None) == compile_now
        for name in ('model.safetensors', 'ema.safetensors'):
            _assert_close_weights(_weights(str(root / target), 'epoch_0002', name),
                                  _weights(str(root / source), 'epoch_0002', name))


def test_weights_saved_with_the_compile_prefix_elsewhere_load(runs, data_dir):
    root, _, _ = runs
    folder = root / 'prefixed' / 'epoch_0001'
    shutil.copytree(root / 'eager' / 'checkpoints' / 'epoch_0001', folder)
    meta = json.loads((folder / 'meta.json').read_text())
    for name in ('model.safetensors', 'ema.safetensors'):
        weights = load_file(folder / name)
        save_file({f'_orig_mod.{key}': value for key, value in weights.items()}, folder / name)
        meta['sha256'][name] = file_sha256(str(folder / name))  # as the run that wrote them recorded them
    (folder / 'meta.json').write_text(json.dumps(meta))
    summary = _train(data_dir, str(root / 'from_prefixed'), resume=str(folder), **{'model.compile': False})
    assert summary['status'] == 'finished'
    for name in ('model.safetensors', 'ema.safetensors'):  # the same states as the unprefixed checkpoint gave
        expected = _weights(str(root / 'eager'), 'epoch_0002', name)
        assert all(torch.equal(value, expected[key])
                   for key, value in _weights(str(root / 'from_prefixed'), 'epoch_0002', name).items())
    assert strip_wrapper_prefixes({'module._orig_mod.a': 1, 'module._orig_mod.b': 2}) == {'a': 1, 'b': 2}
    assert strip_wrapper_prefixes({'_orig_mod.a': 1, 'b': 2}) == {'_orig_mod.a': 1, 'b': 2}  # not every key: kept


def test_reduce_overhead_compiles_the_whole_model_for_static_shapes_and_pads_evaluation(data_dir, tmp_path):
    torch._dynamo.reset()
    graphs_before = torch._dynamo.utils.counters['stats']['unique_graphs']
    summary = _train(data_dir, str(tmp_path / 'run'), **{'model.compile': True, 'model.compile_mode': 'reduce-overhead',
                                                         'model.compile_scope': 'whole', 'train.epochs': 1})
    assert summary['status'] == 'finished'
    # what ran: no CUDA graphs on the CPU
    assert summary['compile'] | {'first_step_s': None} == dict(scope='whole', mode='default', static_shapes=True,
                                                               requested_mode='reduce-overhead', first_step_s=None)
    # one graph for training, one for evaluation: the partial last evaluation batch was padded, not recompiled
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] - graphs_before == 2
    (line,) = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
    assert line['val_samples'] == 24
    log = open(tmp_path / 'run' / 'train.log').read()
    assert 'records CUDA graphs, which need a CUDA device' in log and '(static shapes)' in log
    # extended by an epoch in the same mode: the optimizer state loads although the gradient buffers exist
    extended = _train(data_dir, str(tmp_path / 'run'), resume='auto', **{
        'model.compile': True, 'model.compile_mode': 'reduce-overhead', 'model.compile_scope': 'whole',
        'train.epochs': 2})
    assert extended['status'] == 'finished' and extended['step'] == 2 * UPDATES_PER_EPOCH


@pytest.mark.parametrize('mode', ['reduce-overhead', 'max-autotune'])
def test_a_cuda_graph_mode_run_stopped_by_ctrl_c_mid_epoch_resumes_auto(data_dir, tmp_path, monkeypatch, mode):
    """The stop / resume cycle (SLURM's requeue too) of a run whose gradients live in buffers of their own; the
    inductor backend is swapped for aot_eager (the same graphs, without inductor's code), since max-autotune's
    kernel search takes minutes on a CPU."""
    compile_regions_as_compiled = compilation.compile_regions
    monkeypatch.setattr(session_module, 'compile_regions', lambda model, run_mode, dynamic: (
        compile_regions_as_compiled(model, run_mode, dynamic, backend='aot_eager')))
    periodic = trainer._periodic_checkpoint

    def save_then_interrupt(session) -> bool:
        saved = periodic(session)
        if session.progress.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C just after the periodic checkpoint of step 2
        return saved
    settings = {'model.compile': True, 'model.compile_mode': mode, 'checkpoint.every_n_steps': 1, 'train.epochs': 1}
    with monkeypatch.context() as interrupting:
        interrupting.setattr(trainer, '_periodic_checkpoint', save_then_interrupt)
        stopped = _train(data_dir, str(tmp_path / 'run'), **settings)
    assert stopped['status'] == 'stopped' and stopped['step'] == 2
    assert stopped['compile']['requested_mode'] == mode and stopped['compile']['static_shapes']
    resumed = _train(data_dir, str(tmp_path / 'run'), resume='auto', **settings)
    assert resumed['status'] == 'finished' and resumed['step'] == UPDATES_PER_EPOCH
    assert 'resumed from ' + str(tmp_path / 'run' / 'checkpoints' / 'step_00000002') in open(
        tmp_path / 'run' / 'train.log').read()
    (line,) = [json.loads(line) for line in open(tmp_path / 'run' / 'metrics.jsonl')]
    assert math.isfinite(line['train_loss']) and line['val_samples'] == 24


def test_an_optimizer_state_loads_into_a_model_that_keeps_its_own_gradients():
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters())
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    accelerator = SimpleNamespace(distributed_type='NO', unwrap_model=lambda module, keep_torch_compile=False: module)
    saved = optimizer_state_dict(accelerator, model, optimizer)
    resumed_model = torch.nn.Linear(4, 3)
    resumed = torch.optim.AdamW(resumed_model.parameters())
    keep_own_gradients(resumed_model)  # as a run compiled with CUDA graphs holds them before it resumes
    buffers = [parameter.grad for parameter in resumed_model.parameters()]
    assert set_optimizer_state(accelerator, resumed_model, resumed, saved) == []
    assert [parameter.grad for parameter in resumed_model.parameters()] == buffers  # the same buffers, kept
    assert all(torch.equal(resumed.state[q]['exp_avg'], optimizer.state[p]['exp_avg'])
               for p, q in zip(model.parameters(), resumed_model.parameters()))


def test_a_compile_mode_without_compilation_is_said_in_the_run_s_log_and_recorded_as_eager(data_dir, tmp_path):
    config = load_config(None, ['model.compile_mode=max-autotune'])  # model.compile auto: not on the CPU
    assert dynamo_plugin(config, cpu=True).backend.name == 'NO'
    summary = _train(data_dir, str(tmp_path / 'run'), **{'model.compile_mode': 'max-autotune', 'train.epochs': 1,
                                                         'train.device': 'cpu'})
    assert summary['status'] == 'finished' and summary['compile'] is None
    said = [line for line in open(tmp_path / 'run' / 'train.log') if 'model.compile_mode' in line]
    assert len(said) == 1 and 'WARNING' in said[0]
    assert 'model.compile_mode max-autotune is not used: model.compile=auto does not compile on cpu' in said[0]
    assert effective_mode('reduce-overhead', 'cpu') == 'default' and effective_mode('reduce-overhead', 'cuda') == \
        'reduce-overhead'
    assert effective_mode('max-autotune', 'cpu') == 'max-autotune-no-cudagraphs'
    assert dynamo_plugin(load_config(None, ['model.compile=true']), cpu=True).backend.name == 'NO'  # regional: ours
    whole = dynamo_plugin(load_config(None, ['model.compile=true', 'model.compile_scope=whole',
                                             'model.compile_mode=max-autotune']), cpu=True)
    assert whole.backend.name == 'INDUCTOR' and whole.mode == 'max-autotune-no-cudagraphs'


def test_the_epoch_speed_leaves_out_the_micro_batch_that_compiled_in_every_start():
    """A compiled epoch stopped and resumed compiles in both starts; its speed leaves out both micro-batches."""
    accelerator = SimpleNamespace(num_processes=1, device=torch.device('cpu'))
    # the first start compiled on its first micro-batch (8 images, 30 s) and stopped after 16 images and 31 s
    first = EpochTally.start(torch.device('cpu'), Progress(), is_main=True)
    session = SimpleNamespace(accelerator=accelerator, first_step_s=None,
                              compile_record=lambda: dict(scope='regional', mode='default'))
    _record_compile_time(session, first, time.perf_counter() - 30.0, images=8)
    assert first.compile_images == 8 and first.compile_seconds == pytest.approx(30.0, abs=1.0)
    assert math.isnan(first.images_per_s())  # nothing but the compiling micro-batch yet
    totals = first.totals(accelerator)
    totals[2:4] = [16, 31.0]  # what its checkpoint saved after the second micro-batch
    totals[6] = 30.0
    resumed = EpochTally.start(torch.device('cpu'), Progress(batch_in_epoch=2, epoch_totals=totals), is_main=True)
    assert (resumed.images, resumed.compile_images, resumed.compile_seconds) == (16, 8, 30.0)
    # the resumed start compiles on 8 images in 20 s; the epoch ends at 48 images, 54 s in all: 32 images in 4 s
    result = EpochResult(loss=1.0, images=48, seconds=54.0, completed=True, compile_images=16, compile_seconds=50.0)
    assert result.images_per_s() == 8.0
    assert EpochResult(loss=1.0, images=48, seconds=2.0, completed=True).images_per_s() == 24.0  # eager
    older = Progress(batch_in_epoch=2, epoch_totals=[3.0, 2.0, 16, 31.0, 0])  # a checkpoint before these were kept
    assert EpochTally.start(torch.device('cpu'), older, is_main=True).compile_images == 0
