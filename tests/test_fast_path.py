"""A model's fast form (lipsformer.fastpath.to_fast_form) against its plain module graph: given and taken back once,
one switch for where the package gives it, the same values and gradients, and stepping aside wherever a module is
hooked, wrapped or parametrized."""
import os
import subprocess
import sys

import pytest
import timm
import torch
import torch.nn as nn
from forms_support import form, in_form
from timm.layers import DropPath, set_layer_config
from tiny_models import TINY_MODELS

from lipsformer import fastpath
from lipsformer.fastpath import blocks, forms, in_fast_form, set_fast_path, to_fast_form, to_plain_form, use_fast_path
from lipsformer.layers import is_plain_module


def _model(name: str, dtype: torch.dtype = torch.float32, drop_path_rate: float = 0.3) -> nn.Module:
    torch.manual_seed(0)
    model = timm.create_model(name, drop_path_rate=drop_path_rate, **TINY_MODELS[name]).to(dtype)
    with torch.no_grad():  # alphas and norms away from their initial values, so that every term shows
        for parameter in model.parameters():
            if parameter.dim() == 1:
                parameter.add_(0.1 * torch.randn_like(parameter))
    return model


def _step(model: nn.Module, x: torch.Tensor, seed: int = 5) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits and every parameter's gradient of one step, drop path drawn from ``seed``."""
    torch.manual_seed(seed)
    model.zero_grad()
    logits = model(x)
    logits.logsumexp(-1).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _both_paths(model: nn.Module, x: torch.Tensor, autocast: bool = False):
    with torch.autocast('cpu', dtype=torch.bfloat16, enabled=autocast):
        with form(model, True):
            fast = _step(model, x)
        plain = _step(model, x)
    return fast, plain


def test_one_switch_as_a_call_and_as_a_context_manager():
    assert use_fast_path()
    with set_fast_path(False):
        assert not use_fast_path()
        with set_fast_path(True):
            assert use_fast_path()
        assert not use_fast_path()
    assert use_fast_path()
    set_fast_path(False)
    try:
        assert not use_fast_path()
    finally:
        set_fast_path(None)
    for config in (dict(exportable=True), dict(scriptable=True)):
        with set_layer_config(**config):  # timm's export and TorchScript configurations turn it off too
            assert not use_fast_path()


@pytest.mark.parametrize('value, expected', [('0', 'False'), ('off', 'False'), ('1', 'True'), ('bad', 'error')])
def test_the_environment_variable_sets_the_switch_at_import(value, expected):
    result = subprocess.run([sys.executable, '-c', 'import lipsformer.fastpath as f; print(f.use_fast_path())'],
                            capture_output=True, text=True, env=dict(os.environ, LIPSFORMER_FAST_PATH=value))
    if expected == 'error':
        assert result.returncode != 0
        assert "LIPSFORMER_FAST_PATH='bad'" in result.stderr and 'set it to 0' in result.stderr
    else:
        assert result.returncode == 0, result.stderr
        assert result.stdout.strip() == expected


@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('name', TINY_MODELS)
def test_fast_and_plain_paths_agree_in_float64(name, training):
    """The same function of the same parameters: equal to rounding, values and every gradient, drop path included."""
    model = _model(name, torch.float64).train(training)
    x = torch.randn(2, 3, 64, 96, dtype=torch.float64)  # cut windows and stripes
    (fast_logits, fast_grads), (plain_logits, plain_grads) = _both_paths(model, x)
    torch.testing.assert_close(fast_logits, plain_logits, rtol=1e-12, atol=1e-12)
    for key, plain_grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[key], plain_grad, rtol=1e-10, atol=1e-12, msg=lambda m: f'{key}: {m}')


@pytest.mark.parametrize('name', TINY_MODELS)
def test_fast_and_plain_paths_agree_in_float32(name):
    """float32 sums in another order (oneDNN's products, the per-image weight gradient): close relative to each
    gradient's size."""
    model = _model(name).train()
    x = torch.randn(3, 3, 64, 96)
    (fast_logits, fast_grads), (plain_logits, plain_grads) = _both_paths(model, x)
    torch.testing.assert_close(fast_logits, plain_logits, rtol=1e-4, atol=1e-5)
    for key, plain_grad in plain_grads.items():
        torch.testing.assert_close(fast_grads[key], plain_grad, rtol=1e-4, atol=1e-5 * plain_grad.abs().max().item(),
                                   msg=lambda m: f'{key}: {m}')


@pytest.mark.parametrize('name', TINY_MODELS)
def test_fast_and_plain_paths_agree_under_bfloat16_autocast(name):
    """Under CPU autocast the fast path's Functions run their backward under the forward's autocast state
    (torch.amp.custom_fwd / custom_bwd): bfloat16 rounding apart, the plain path's values and gradients."""
    model = _model(name).train()
    x = torch.randn(3, 3, 64, 96)
    (fast_logits, fast_grads), (plain_logits, plain_grads) = _both_paths(model, x, autocast=True)
    torch.testing.assert_close(fast_logits.float(), plain_logits.float(), rtol=0.05, atol=0.02)
    for key, plain_grad in plain_grads.items():
        assert fast_grads[key].dtype == plain_grad.dtype == torch.float32
        scale = plain_grad.abs().max().item()
        torch.testing.assert_close(fast_grads[key], plain_grad, rtol=0.1, atol=0.03 * scale,
                                   msg=lambda m: f'{key}: {m}')


@pytest.mark.parametrize('alpha', ['folded', 'after the branch'])
def test_a_kept_path_is_scaled_as_the_plain_graph_scales_it_under_autocast(alpha):
    """Under bfloat16 autocast the plain graph's drop path follows a float32 alpha: it draws its keep mask in float32
    and divides it by the keep probability there. The fast form's residual drops the same samples from the same seed
    and scales a kept branch by the same float32 factor (1 / 0.9, not its 8-bit rounding 1.109375)."""
    drop = DropPath(0.1).train()
    x = torch.randn(64, 5, 16)
    branch = torch.randn(64, 5, 16).bfloat16()
    gamma = torch.ones(16) if alpha == 'folded' else torch.rand(16) + 0.5
    with torch.autocast('cpu', dtype=torch.bfloat16):
        torch.manual_seed(3)
        plain = x + drop(branch * gamma)  # ResidualAlpha, then DropPath
        torch.manual_seed(3)
        fast = blocks.weighted_residual(x, branch, None if alpha == 'folded' else gamma, drop)
    assert fast.dtype == plain.dtype == torch.float32
    dropped = (plain == x).flatten(1).all(1)
    assert 0 < dropped.sum() < len(dropped)  # both kinds of sample, the same ones
    torch.testing.assert_close(fast, plain, rtol=1e-6, atol=1e-6)


@pytest.fixture
def fused_calls(monkeypatch):
    """Counts the fast form's fused compositions, by name."""
    calls = {'mlp': 0, 'conv_shortcut': 0, 'weighted_residual': 0}
    for name in calls:
        original = getattr(forms, name)

        def counted(*args, _name=name, _original=original, **kwargs):
            calls[_name] += 1
            return _original(*args, **kwargs)

        monkeypatch.setattr(forms, name, counted)
    return calls


@pytest.mark.parametrize('name', TINY_MODELS)
def test_a_hooked_module_is_called_and_its_hook_sees_what_the_plain_path_computes(name, fused_calls):
    model = _model(name, drop_path_rate=0.0).eval()
    x = torch.randn(2, 3, 64, 64)
    blocks_count = sum(len(stage.blocks) for stage in model.stages)
    shortcuts = sum(len(block.conv_shortcuts) for stage in model.stages for block in stage.blocks)
    with torch.no_grad():
        plain = model(x)
        assert fused_calls == {'mlp': 0, 'conv_shortcut': 0, 'weighted_residual': 0}  # timm's model is plain
        reference = in_form(model, True)(x)
        assert fused_calls == {'mlp': blocks_count, 'conv_shortcut': shortcuts, 'weighted_residual': 2 * blocks_count}
    block = model.stages[0].blocks[0]
    seen = {}
    hooks = [block.mlp.fc2.register_forward_hook(lambda m, i, o: seen.setdefault('fc2', o)),
             block.conv_shortcuts[0].dw.register_forward_pre_hook(lambda m, i: seen.setdefault('dw', i[0])),
             block.attn.proj.register_forward_hook(lambda m, i, o: seen.setdefault('proj', o))]
    for key in fused_calls:
        fused_calls[key] = 0
    with torch.no_grad():
        hooked = model(x)
    for hook in hooks:
        hook.remove()
    # That block's MLP and first shortcut ran through their modules; every other one was fused.
    assert fused_calls['mlp'] == blocks_count - 1 and fused_calls['conv_shortcut'] == shortcuts - 1
    assert set(seen) == {'fc2', 'dw', 'proj'}
    assert seen['dw'].shape[1] == block.conv_shortcuts[0].dw.in_channels  # NCHW, as nn.Conv2d takes it
    torch.testing.assert_close(hooked, reference, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(hooked, plain, rtol=1e-5, atol=1e-6)
    with form(model, False), torch.no_grad():
        block.mlp.fc2.register_forward_hook(lambda m, i, o: seen.__setitem__('plain_fc2', o))
        model(x)
    torch.testing.assert_close(seen['fc2'], seen['plain_fc2'], rtol=1e-5, atol=1e-6)


def test_a_parametrized_weight_is_used():
    """spectral norm via torch.nn.utils.parametrize (a subclass of the module) on the attention's projection and an
    MLP's fc2: the fast path steps aside for both, and the output is the plain path's."""
    name = 'lipsformer_cswin_tiny'
    model = _model(name, drop_path_rate=0.0).eval()
    block = model.stages[2].blocks[0]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        before = model(x)
    nn.utils.parametrizations.spectral_norm(block.attn.proj)
    nn.utils.parametrizations.spectral_norm(block.mlp.fc2)
    assert not is_plain_module(block.attn.proj, nn.Linear) and not blocks.mlp_is_plain(block.mlp)
    with torch.no_grad():
        plain = model(x)
        fast = in_form(model, True)(x)
    torch.testing.assert_close(fast, plain, rtol=1e-5, atol=1e-6)
    assert (fast - before).abs().max() > 1e-4  # the normalised weights changed the output


@pytest.mark.parametrize('name', TINY_MODELS)
def test_gradient_penalties_differentiate_the_backward(name):
    """A gradient penalty needs the backward's own gradient (create_graph=True): the fast path's Functions record a
    backward that autograd differentiates again, equal to the plain path's in float64."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    model = _model(name, torch.float64).train()
    results = []
    for fast in (True, False):
        # PyTorch's fused CPU attention kernels have no double backward: the plain path's is SDPA's math backend.
        with form(model, fast), sdpa_kernel(SDPBackend.MATH):
            torch.manual_seed(1)
            x = torch.randn(2, 3, 64, 64, dtype=torch.float64, requires_grad=True)
            (input_grad,) = torch.autograd.grad(model(x).logsumexp(-1).sum(), x, create_graph=True)
            penalty = input_grad.square().sum()
            results.append((penalty.detach(), torch.autograd.grad(penalty, list(model.parameters()))))
    (fast_penalty, fast_grads), (plain_penalty, plain_grads) = results
    torch.testing.assert_close(fast_penalty, plain_penalty, rtol=1e-10, atol=0)
    for fast_grad, plain_grad in zip(fast_grads, plain_grads, strict=True):
        torch.testing.assert_close(fast_grad, plain_grad, rtol=1e-8, atol=1e-12)


def test_the_switch_is_on_by_default_only_on_the_devices_where_it_is_measured_faster():
    assert fastpath.DEFAULT_DEVICES == {'cpu', 'cuda'}
    assert use_fast_path('cpu') and use_fast_path('cuda') and not use_fast_path('mps') and not use_fast_path('xpu')
    with set_fast_path(True):  # on for every device
        assert use_fast_path('cuda') and use_fast_path('cpu') and use_fast_path('mps')
        with set_fast_path(None):  # the defaults again
            assert use_fast_path('cpu') and not use_fast_path('mps')
    with set_fast_path(False):
        assert not use_fast_path('cpu') and not use_fast_path('cuda')


@pytest.mark.parametrize('value, cpu, mps', [('auto', True, False), ('1', True, True), ('0', False, False)])
def test_the_environment_variable_overrides_the_device_defaults(value, cpu, mps):
    code = 'import lipsformer.fastpath as f; print(f.use_fast_path("cpu"), f.use_fast_path("mps"))'
    result = subprocess.run([sys.executable, '-c', code], capture_output=True, text=True,
                            env=dict(os.environ, LIPSFORMER_FAST_PATH=value))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == [str(cpu), str(mps)]


@pytest.mark.parametrize('name', TINY_MODELS)
def test_the_fast_form_is_given_once_and_taken_back(name):
    """``to_fast_form`` gives the blocks and SCSA their fast classes (and, for the CPU, the mixers' oneDNN product),
    nothing else of the model changes, and ``to_plain_form``
    gives back exactly what timm built; with the switch off for the device the model is left as it is."""
    model = _model(name, drop_path_rate=0.0).eval()
    plain_types = {key: type(module) for key, module in model.named_modules()}
    state = {key: value.clone() for key, value in model.state_dict().items()}
    assert not in_fast_form(model)
    with set_fast_path(False):
        assert to_fast_form(model, 'cpu') is model and not in_fast_form(model)
    assert to_fast_form(model, 'mps') is model and not in_fast_form(model)  # not a default device
    assert to_fast_form(model, 'cpu') is model and in_fast_form(model)
    changed = {key: type(module) for key, module in model.named_modules() if type(module) is not plain_types[key]}
    assert {cls.__name__ for cls in changed.values()} >= {'FastLipsFormerBlock', 'FastScaledCosineAttention'}
    assert all(isinstance(model.get_submodule(key), plain_types[key]) for key in changed)
    assert all(torch.equal(value, state[key]) for key, value in model.state_dict().items())
    assert to_plain_form(model) is model and not in_fast_form(model)
    assert {key: type(module) for key, module in model.named_modules()} == plain_types


@pytest.mark.parametrize('name', TINY_MODELS)
def test_a_fast_form_pickles_and_copies_in_its_form(name):
    """``torch.save`` of the whole module and ``copy.deepcopy`` give the fast form again (the CPU mixers' classes are
    made at run time), with the same values; an unpickled model goes back to its plain form."""
    import copy
    import io
    model = to_fast_form(_model(name, drop_path_rate=0.0).eval(), 'cpu')
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad():
        expected = model(x)
    buffer = io.BytesIO()
    torch.save(model, buffer)
    buffer.seek(0)
    for restored in (torch.load(buffer, weights_only=False), copy.deepcopy(model)):
        assert [type(module) for module in restored.modules()] == [type(module) for module in model.modules()]
        with torch.no_grad():
            assert torch.equal(restored(x), expected)
        assert not in_fast_form(to_plain_form(restored))


def test_the_models_and_layers_know_nothing_of_the_fast_form():
    """Read from the source: the models and the layers neither import the fast path nor ask whether one runs."""
    import inspect

    import lipsformer.layers
    import lipsformer.models._base
    for module in (lipsformer.models._base, *(getattr(lipsformer.layers, name) for name in dir(lipsformer.layers)
                                               if inspect.ismodule(getattr(lipsformer.layers, name)))):
        source = inspect.getsource(module)
        assert 'import fastpath' not in source and 'from ..fastpath' not in source, module.__name__
        assert 'def _fast_' not in source and 'engaged' not in source, module.__name__
    forward_lines = inspect.getsource(lipsformer.models._base.LipsFormerBlock.forward).strip().splitlines()
    assert len(forward_lines) <= 12


def test_a_fast_form_refuses_torchscript_naming_the_plain_form():
    model = in_form(_model('lipsformer_swin_tiny', drop_path_rate=0.0).eval(), True)
    scripted = torch.jit.script(model)
    with pytest.raises(Exception, match=r'lipsformer\.fastpath\.to_plain_form\(model\)'):
        scripted(torch.randn(1, 3, 64, 64))


def test_model_families_know_nothing_of_the_fast_path():
    """A family implements its attention before the output projection (``attend``) and nothing else: no fast-path
    imports, no output scale in its signature."""
    import inspect

    from lipsformer.models import lipsformer_cswin, lipsformer_swin
    for module in (lipsformer_swin, lipsformer_cswin):
        source = inspect.getsource(module)
        assert 'fastpath' not in source and 'out_scale' not in source, module.__name__
    for mixer in (lipsformer_swin.WindowAttention, lipsformer_cswin.CrossStripeAttention):
        assert 'forward' not in vars(mixer) and list(inspect.signature(mixer.attend).parameters) == ['self', 'x']


@pytest.mark.parametrize('fast', [True, False], ids=['fast', 'plain'])
@pytest.mark.parametrize('name', list(TINY_MODELS))
def test_a_batch_of_zero_images_gives_zero_logits_rows(name, fast):
    """oneDNN's 1x1 convolution refuses an empty map (``padded input size per channel: (1 x 0)``); the plain graph
    returns (0, classes)."""
    model = in_form(_model(name).eval(), fast)
    with torch.no_grad():
        assert model(torch.randn(0, 3, 64, 64)).shape == (0, model.num_classes)


@pytest.mark.parametrize('fast', [True, False], ids=['fast', 'plain'])
@pytest.mark.parametrize('name', list(TINY_MODELS))
def test_a_training_step_on_a_batch_of_zero_images(name, fast):
    model = in_form(_model(name).train(), fast)
    logits = model(torch.randn(0, 3, 64, 64))
    logits.logsumexp(-1).sum().backward()
    assert logits.shape == (0, model.num_classes)
    assert all(p.grad is None or not p.grad.any() for p in model.parameters())  # no image: no gradient


def test_the_fast_kernels_take_an_empty_batch():
    """The token-wise linear (oneDNN's 1x1 convolution) and the 7x7 depthwise convolution's weight gradient (an image
    at a time) on a batch of 0: empty outputs and zero gradients, as the plain operators give."""
    from lipsformer.fastpath.depthwise_conv_op import depthwise_conv2d_op as depthwise_conv2d
    from lipsformer.fastpath.onednn_linear import linear_backward, onednn_linear
    x, weight, bias = torch.randn(0, 49, 64), torch.randn(32, 64), torch.randn(32)
    assert onednn_linear(x, weight, bias).shape == (0, 49, 32)
    grad_x, grad_weight, grad_bias = linear_backward(torch.randn(0, 49, 32), x, weight, True, True, True)
    assert grad_x.shape == x.shape and torch.equal(grad_weight, torch.zeros(32, 64))
    assert torch.equal(grad_bias, torch.zeros(32))
    image, kernel = torch.randn(0, 8, 8, 64, requires_grad=True), torch.randn(64, 1, 7, 7, requires_grad=True)
    out = depthwise_conv2d(image, kernel, None)
    assert out.shape == (0, 8, 8, 64)
    out.sum().backward()
    assert image.grad.shape == image.shape and torch.equal(kernel.grad, torch.zeros_like(kernel))
