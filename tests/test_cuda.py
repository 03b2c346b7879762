"""The GPU checks in one command, ``python -m pytest tests/test_cuda.py`` (every test skips without CUDA).

Both families at their default size (224): forward and backward through their fast form
(``lipsformer.fastpath.to_fast_form`` for CUDA), in float32 and under bf16 autocast, equal to the plain module graph
``timm.create_model`` returns, the Triton normalisation kernels against PyTorch's, ``torch.compile``
equal to eager, a 20-step training run through ``lipsformer.training`` whose loss falls (compiled:
``model.compile=auto``), a run with CUDA graphs (``reduce-overhead``) and gradient accumulation that ends with eager's
weights, such a run stopped by Ctrl-C mid-epoch and resumed, the benchmark's CUDA path, and at 256x320 (padded windows
and stripes) the gradient norm at its 224 scale, finite float16 and bfloat16 logits and no gradient at the padded tokens
through the fused attention.
"""
import contextlib
import json
import math
import os
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn.functional as F
from forms_support import form
from image_data import make_image_folder
from padding_support import assert_no_gradient_at_the_padding, recording_padding, zero_lepe
from tool_support import FAMILIES
from training_support import tiny_overrides

from lipsformer.training import load_config, train
from lipsformer.weights.weight_files import load_file

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason='needs a CUDA device')

DEVICE = 'cuda'
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Relative to the reference's scale: float32 differs by summation order; bf16 by its 8-bit mantissa through a dozen
# blocks, on either side of the comparison.
TOLERANCES = {'fp32': 1e-3, 'bf16': 5e-2}


@pytest.fixture(autouse=True)
def _full_float32():
    """Float32 products in float32, not TF32 (whose 10-bit mantissa would hide a float32 difference)."""
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn


def _default_model(name: str) -> torch.nn.Module:
    return timm.create_model(name, drop_path_rate=0.0).to(DEVICE)  # dropouts are 0 by default: deterministic


def _batch(size: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(size, 3, 224, 224, device=DEVICE), torch.randint(0, 1000, (size,), device=DEVICE)


def _step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, precision: str = 'fp32', forward=None
          ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One forward (through ``forward``, default the model) and backward: the logits (float32) and the gradient of
    every parameter of the model."""
    model.zero_grad(set_to_none=True)
    autocast = torch.autocast(DEVICE, dtype=torch.bfloat16) if precision == 'bf16' else contextlib.nullcontext()
    with autocast:
        # `forward or model` would ask a compiled module for its len() (OptimizedModule defines __len__)
        logits = (model if forward is None else forward)(x)
    F.cross_entropy(logits.float(), y).backward()
    return logits.detach().float(), {n: p.grad.detach().float().clone() for n, p in model.named_parameters()}


def _assert_same_step(actual, expected, tolerance: float) -> None:
    (logits, grads), (expected_logits, expected_grads) = actual, expected
    scale = expected_logits.abs().max().item()
    torch.testing.assert_close(logits, expected_logits, rtol=tolerance, atol=tolerance * scale)
    assert grads.keys() == expected_grads.keys()
    scale = max(g.abs().max().item() for g in expected_grads.values())  # all gradients at one scale
    for n, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[n], rtol=tolerance, atol=tolerance * scale,
                                   msg=lambda message, n=n: f'grad {n}: {message}')


@pytest.mark.parametrize('precision', ['fp32', 'bf16'])
@pytest.mark.parametrize('name', FAMILIES)
def test_forward_backward_equal_the_plain_path(name, precision):
    model = _default_model(name).train()
    x, y = _batch()
    with form(model, True, 'cuda'):
        fast = _step(model, x, y, precision)
    plain = _step(model, x, y, precision)
    _assert_same_step(fast, plain, TOLERANCES[precision])


@pytest.mark.parametrize('dtype', [torch.float32, torch.bfloat16])
def test_triton_l2_normalize_equals_f_normalize(dtype):
    from lipsformer.fastpath import l2_normalize_op
    qkv = torch.randn(256, 49, 3, 4, 32, device=DEVICE, dtype=dtype)
    q = qkv.permute(2, 0, 3, 1, 4)[0].requires_grad_()
    reference = q.detach().float().requires_grad_()
    assert l2_normalize_op.l2_normalize_kernels_run_on(q)
    y = l2_normalize_op.l2_normalize_op(q, 1e-12, 12.0)
    expected = F.normalize(reference, dim=-1) * 12.0
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(y.float(), expected, rtol=tolerance, atol=tolerance * 12)
    grad = torch.randn_like(expected)
    y.backward(grad.to(dtype))
    expected.backward(grad)
    torch.testing.assert_close(q.grad.float(), reference.grad, rtol=tolerance * 10, atol=tolerance * 10)


@pytest.mark.parametrize('name', FAMILIES)
def test_torch_compile_equals_eager(name):
    torch._dynamo.reset()
    model = _default_model(name).train()
    x, y = _batch()
    eager = _step(model, x, y)
    compiled = _step(model, x, y, forward=torch.compile(model, fullgraph=True))
    _assert_same_step(compiled, eager, TOLERANCES['fp32'])


def test_twenty_training_steps_lower_the_loss(tmp_path):
    """4 epochs of 5 steps (40 images, batch 8) in bf16 autocast: no augmentation or drop path, so that the loss of
    the last epoch below the first's is the optimizer's doing."""
    data_dir = make_image_folder(str(tmp_path / 'images'), train_per_class=10)
    overrides = tiny_overrides(data_dir, **{
        'train.epochs': 4, 'train.mixed_precision': 'bf16', 'model.drop_path_rate': 0.0, 'augment.reprob': 0.0,
        'augment.scale': '[1.0, 1.0]', 'augment.ratio': '[1.0, 1.0]', 'augment.hflip': 0.0,
        'augment.color_jitter': 0.0, 'augment.mixup': 0.0, 'augment.cutmix': 0.0})
    torch.cuda.reset_peak_memory_stats()
    run_dir = tmp_path / 'run'
    summary = train(load_config(None, overrides), str(run_dir))
    assert summary['status'] == 'finished'
    assert torch.cuda.max_memory_allocated() > 0  # it ran on the GPU
    lines = [json.loads(line) for line in (run_dir / 'metrics.jsonl').read_text().splitlines()]
    assert [line['step'] for line in lines] == [5, 10, 15, 20]
    losses = [line['train_loss'] for line in lines]
    assert losses[-1] < losses[0], losses


def test_cuda_graphs_train_with_accumulation_clipping_constraint_and_ema_as_eager(tmp_path):
    """model.compile_mode=reduce-overhead against eager, float32: a CUDA graph's outputs are overwritten by its next
    replay, so an accumulation window whose gradients lived there would end with the last micro-batch's alone."""
    data_dir = make_image_folder(str(tmp_path / 'images'))
    overrides = tiny_overrides(data_dir, **{
        'train.epochs': 1, 'train.mixed_precision': 'no', 'train.grad_accum_steps': 2, 'optimizer.clip_grad': 1.0,
        'lipschitz.enabled': True, 'model.drop_path_rate': 0.0})  # drop path: compiled and eager draw differently
    weights = {}
    for mode in ('eager', 'reduce-overhead'):
        settings = ['model.compile=false'] if mode == 'eager' else ['model.compile=true', f'model.compile_mode={mode}']
        summary = train(load_config(None, [*overrides, *settings]), str(tmp_path / mode))
        assert summary['status'] == 'finished'
        folder = tmp_path / mode / 'checkpoints' / 'epoch_0001'
        weights[mode] = {name: load_file(folder / name) for name in ('model.safetensors', 'ema.safetensors')}
    for name, expected in weights['eager'].items():
        for key, value in weights['reduce-overhead'][name].items():
            error = ((value - expected[key]).norm() / expected[key].norm().clamp(min=1e-12)).item()
            assert error < TOLERANCES['fp32'], f'{name} {key}: relative difference {error:.2e}'


def test_benchmark_runs_on_cuda(tmp_path):
    out = tmp_path / 'report.json'
    completed = subprocess.run(
        [sys.executable, '-m', 'lipsformer.instruments.benchmark', '--models', ','.join(FAMILIES), '--mode',
         'infer,train',
         '--batch-size', '8', '--img-size', '224', '--precision', 'bf16', '--device', DEVICE, '--warmup', '2',
         '--repeats', '2', '--steps', '2', '--json', str(out)],
        cwd=REPO, capture_output=True, text=True)
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report['environment']['gpu'] and report['environment']['memory_metric'] == 'cuda_max_memory_allocated'
    rows = {(row['model'], row['mode']): row for row in report['results']}
    assert rows.keys() == {(name, mode) for name in FAMILIES for mode in ('infer', 'train')}
    for row in rows.values():
        assert row['images_per_s'] > 0 and row['peak_memory_mb'] > 0, row


def _gradient_norm_at(model: torch.nn.Module, size: tuple[int, int]) -> float:
    """The global gradient norm of one backward of a fixed loss at an input size (the padded windows' and stripes'
    scale: a padded token's 1 / eps factor would multiply it by about 1e8)."""
    torch.manual_seed(0)
    model.zero_grad(set_to_none=True)
    model(torch.randn(2, 3, *size, device=DEVICE)).logsumexp(-1).mean().backward()
    return torch.nn.utils.get_total_norm([p.grad for p in model.parameters() if p.grad is not None]).item()


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('name', FAMILIES)
def test_padded_size_keeps_the_gradient_norm_and_finite_half_precision_logits(name, fast):
    """At 256x320 Swin pads its 7x7 windows (maps 64x80, 32x40, 16x20, 8x10) and CSwin its 7-wide stripes."""
    model = _default_model(name).train()
    with form(model, fast, 'cuda'):
        unpadded, padded = _gradient_norm_at(model, (224, 224)), _gradient_norm_at(model, (256, 320))
        assert unpadded / 3 < padded < unpadded * 3
        x = torch.randn(2, 3, 256, 320, device=DEVICE)
        for dtype in (torch.float16, torch.bfloat16):
            model.to(dtype)
            with torch.no_grad():
                assert torch.isfinite(model.eval()(x.to(dtype))).all(), dtype
            model.train().zero_grad(set_to_none=True)
            model(x.to(dtype)).float().logsumexp(-1).mean().backward()
            assert all(torch.isfinite(p.grad).all() for p in model.parameters() if p.grad is not None), dtype
        model.float()
        with torch.autocast(DEVICE, dtype=torch.float16), torch.no_grad():
            assert torch.isfinite(model.eval()(x)).all()


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16, torch.bfloat16], ids=['fp32', 'fp16', 'bf16'])
@pytest.mark.parametrize('name', FAMILIES)
def test_no_gradient_reaches_the_padded_tokens_through_cuda_attention(name, dtype, fast):
    """PyTorch's fused CUDA attention kernels give padded (-inf masked) keys, and the cut-off padded queries, exactly
    zero gradient at 256x320, as the CPU's do (tests/test_padding.py); CSwin's LePE is zeroed (see zero_lepe)."""
    model = _default_model(name).to(dtype).train()
    zero_lepe(model)
    torch.manual_seed(0)
    with form(model, fast, 'cuda'), recording_padding() as padded_tensors:
        model(torch.randn(2, 3, 256, 320, device=DEVICE, dtype=dtype)).float().logsumexp(-1).mean().backward()
    assert_no_gradient_at_the_padding(padded_tensors)


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float32])
def test_triton_l2_normalize_of_a_zero_row_is_zero(dtype):
    """A padded token's zero q at float16's floor (2**-14), where tau / eps = 163840 is past float16's range."""
    from lipsformer.fastpath import l2_normalize_op
    x = torch.randn(2, 49, 32, device=DEVICE, dtype=dtype)
    x[:, 40:] = 0.0
    x.requires_grad_()
    assert l2_normalize_op.l2_normalize_kernels_run_on(x)
    y = l2_normalize_op.l2_normalize_op(x, 2.0 ** -14, 10.0)
    assert torch.isfinite(y).all() and not y[:, 40:].any()
    grad = torch.randn_like(y)
    grad[:, 40:] = 0.0
    y.backward(grad)
    assert torch.isfinite(x.grad).all() and not x.grad[:, 40:].any()


@pytest.mark.parametrize('name', FAMILIES)
def test_torch_compile_of_a_fast_form_equals_the_eager_plain_model(name):
    """A fast form compiled: the blocks step aside for their plain forward under dynamo, equal to the eager plain
    model."""
    torch._dynamo.reset()
    model = _default_model(name).train()
    x, y = _batch()
    eager = _step(model, x, y)
    with form(model, True, 'cuda'):
        compiled = _step(model, x, y, forward=torch.compile(model, fullgraph=True))
    _assert_same_step(compiled, eager, TOLERANCES['fp32'])


@pytest.mark.parametrize('scope', ['regional', 'whole'])
def test_cuda_graphs_runs_stop_and_resume_in_either_compile_scope(tmp_path, scope):
    """A run compiled with CUDA graphs (reduce-overhead), ended and extended by an epoch with resume='auto', as a
    SLURM requeue does: its optimizer state loads although the run keeps gradient buffers of its own."""
    data_dir = make_image_folder(str(tmp_path / 'images'))
    settings = ['model.compile=true', 'model.compile_mode=reduce-overhead', f'model.compile_scope={scope}']
    overrides = tiny_overrides(data_dir, **{'train.mixed_precision': 'bf16', 'model.drop_path_rate': 0.0})
    run_dir = str(tmp_path / 'run')
    first = train(load_config(None, [*overrides, 'train.epochs=1', *settings]), run_dir)
    assert first['status'] == 'finished' and first['compile']['mode'] == 'reduce-overhead'
    extended = train(load_config(None, [*overrides, 'train.epochs=2', *settings]), run_dir, resume='auto')
    assert extended['status'] == 'finished' and extended['step'] == 2 * first['step']
    lines = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    assert [line['epoch'] for line in lines] == [1, 2] and all(math.isfinite(line['train_loss']) for line in lines)


def test_cuda_graphs_run_stopped_by_ctrl_c_mid_epoch_resumes_auto(tmp_path, monkeypatch):
    """A run compiled with CUDA graphs (reduce-overhead) stopped by Ctrl-C just after a periodic checkpoint in the
    middle of its epoch, then continued with resume='auto' as a SLURM requeue does: the optimizer state loads although
    the run keeps gradient buffers of its own, and the continued run finishes the epoch."""
    import signal

    import lipsformer.training.trainer as trainer
    data_dir = make_image_folder(str(tmp_path / 'images'))  # 48 training images, batch 8: 6 updates
    overrides = tiny_overrides(data_dir, **{
        'train.mixed_precision': 'bf16', 'model.drop_path_rate': 0.0, 'train.epochs': 1,
        'checkpoint.every_n_steps': 1, 'model.compile': 'true', 'model.compile_mode': 'reduce-overhead'})
    periodic = trainer._periodic_checkpoint

    def save_then_interrupt(session) -> bool:
        saved = periodic(session)
        if session.progress.step == 2:
            os.kill(os.getpid(), signal.SIGINT)  # a Ctrl-C just after the checkpoint of step 2
        return saved
    run_dir = str(tmp_path / 'run')
    with monkeypatch.context() as interrupting:
        interrupting.setattr(trainer, '_periodic_checkpoint', save_then_interrupt)
        stopped = train(load_config(None, overrides), run_dir)
    assert stopped['status'] == 'stopped' and stopped['step'] == 2
    assert stopped['compile']['mode'] == stopped['compile']['requested_mode'] == 'reduce-overhead'
    resumed = train(load_config(None, overrides), run_dir, resume='auto')
    assert resumed['status'] == 'finished' and resumed['step'] == 6
    log = (tmp_path / 'run' / 'train.log').read_text()
    assert 'resumed from ' + os.path.join(run_dir, 'checkpoints', 'step_00000002') in log
    (line,) = [json.loads(line) for line in (tmp_path / 'run' / 'metrics.jsonl').read_text().splitlines()]
    assert math.isfinite(line['train_loss']) and math.isfinite(line['val_loss'])
