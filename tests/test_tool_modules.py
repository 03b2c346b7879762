"""Tools that act on modules, run on both families and on timm's Swin: PEFT LoRA, forward hooks and pre-hooks,
parametrizations (torch.nn.utils.parametrize, spectral norm in its parametrization and its hook form) and
torch.ao's dynamic quantization.

Each works only if every parameterised layer runs through its module's ``forward`` (``__call__``): a layer whose
weight is read by another module (``F.linear(x, self.fc2.weight)``) escapes hooks and module replacement, and LoRA
adapters on it get no gradient.
"""
import copy
import warnings
from collections import Counter

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from tool_support import FORMS_WITH_CONTROL, build

peft = pytest.importorskip('peft')

pytestmark = pytest.mark.usefixtures('one_thread')

# The projections users adapt with LoRA (timm's Swin and ViT names them so too).
LORA_TARGETS = ['qkv', 'proj', 'fc1', 'fc2']


def _images(batch: int = 2) -> torch.Tensor:
    return torch.randn(batch, 3, 64, 64)


def _lora_parameters(model: nn.Module) -> dict[str, nn.Parameter]:
    return {name: p for name, p in model.named_parameters() if 'lora_' in name}


@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_lora_on_qkv_proj_fc1_fc2_gives_every_adapter_a_gradient(name, form):
    model = build(name, form, drop_path_rate=0.0)
    # Random A and B (not LoRA's zero B): every adapter then changes the output, and A's gradient is not zero.
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=LORA_TARGETS, init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    wrapped = {n.rsplit('.', 1)[-1] for n, m in lora.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)}
    assert wrapped == set(LORA_TARGETS)
    adapters = _lora_parameters(lora)
    assert adapters and all(p.requires_grad for p in adapters.values())
    F.cross_entropy(lora(_images()), torch.tensor([1, 2])).backward()
    silent = [n for n, p in adapters.items() if p.grad is None or not p.grad.any()]
    assert not silent, f'{len(silent)} of {len(adapters)} LoRA parameters got no gradient, e.g. {silent[:4]}'


@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_lora_merge_and_unload_keeps_the_logits(name, form):
    model = build(name, form).eval()
    x = _images()
    with torch.no_grad():
        base = model(x)
    config = peft.LoraConfig(r=2, lora_alpha=2, target_modules=LORA_TARGETS, init_lora_weights=False)
    lora = peft.get_peft_model(model, config)
    assert all(p.any() for n, p in _lora_parameters(lora).items() if 'lora_B' in n)
    with torch.no_grad():
        unmerged = lora(x)
        merged_model = lora.merge_and_unload()
        merged = merged_model(x)
    assert not _lora_parameters(merged_model)
    assert (unmerged - base).abs().max() > 1e-2  # the adapters matter, so the comparison below means something
    torch.testing.assert_close(merged, unmerged, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_lora_on_fc1_alone_trains(name, form):
    model = build(name, form, drop_path_rate=0.0)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=['fc1']))  # LoRA's own init: B = 0
    trainable = [p for p in lora.parameters() if p.requires_grad]
    assert trainable and all('lora_' in n for n, p in lora.named_parameters() if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    x, y = _images(4), torch.tensor([0, 1, 2, 3])
    losses = []
    for step in range(3):
        loss = F.cross_entropy(lora(x), y)
        optimizer.zero_grad()
        loss.backward()
        if step == 0:
            silent = [n for n, p in _lora_parameters(lora).items() if 'lora_B' in n and not p.grad.any()]
            assert not silent, f'LoRA B matrices without a gradient: {silent[:4]}'
        optimizer.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0], losses


def _parameterised_modules(model: nn.Module) -> dict[str, nn.Module]:
    """Every module that holds parameters itself (linear and conv layers, norms, alpha scales, bias tables)."""
    return {n: m for n, m in model.named_modules() if next(m.parameters(recurse=False), None) is not None}


@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_hooks_and_pre_hooks_fire_once_on_every_parameterised_module(name, form):
    model = build(name, form, drop_path_rate=0.0)
    modules = _parameterised_modules(model)
    layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    assert set(layers) <= set(modules)
    before, after = Counter(), Counter()
    for n, module in modules.items():
        module.register_forward_pre_hook(lambda m, args, n=n: before.update([n]))
        module.register_forward_hook(lambda m, args, out, n=n: after.update([n]))
    for training, grad in ((False, False), (True, True)):  # each path an implementation may pick
        before.clear()
        after.clear()
        model.train(training)
        with torch.set_grad_enabled(grad):
            model(_images())
        missed = sorted(set(modules) - set(after))
        kinds = Counter(type(modules[n]).__name__ for n in missed)
        assert not missed, (f'training={training}: {len(missed)} of {len(modules)} modules with parameters never '
                            f'called ({dict(kinds)}), e.g. {missed[:6]}')
        assert before == after == Counter(list(modules))


@pytest.mark.parametrize('kind', ['pre', 'post'])
@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_hooks_that_double_every_linear_and_conv_act_as_doubled_weights(name, form, kind):
    """A pre-hook doubling each layer's input is the layer with its weight doubled; a hook doubling its output, with
    weight and bias doubled. Doubling is exact in floating point, so the models must agree to rounding."""
    model = build(name, form).eval()
    reference = copy.deepcopy(model)
    layers = [n for n, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Conv2d))]
    with torch.no_grad():
        for n in layers:
            module, twin = model.get_submodule(n), reference.get_submodule(n)
            twin.weight.mul_(2)
            if kind == 'pre':
                module.register_forward_pre_hook(lambda m, args: (args[0] * 2, *args[1:]))
            else:
                module.register_forward_hook(lambda m, args, out: out * 2)
                if twin.bias is not None:
                    twin.bias.mul_(2)
        x = _images()
        out, expected = model(x), reference(x)
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


class _Scale(nn.Module):
    """A parametrization: the weight times a constant."""

    def __init__(self, factor: float) -> None:
        super().__init__()
        self.factor = factor

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight * self.factor


def _hook_spectral_norm(module: nn.Module) -> torch.Tensor:
    """``torch.nn.utils.spectral_norm`` (the forward-pre-hook form) on the module, its power-iteration vectors set to
    the weight's top singular vectors; returns the weight its hook sets in an eval-mode forward, weight_orig / sigma
    (no power iteration in eval mode, and sigma = u . W v is then the largest singular value)."""
    with warnings.catch_warnings():
        warnings.simplefilter('ignore')
        torch.nn.utils.spectral_norm(module)
    weight = module.weight_orig.detach()
    left, singular_values, right = torch.linalg.svd(weight.flatten(1), full_matrices=False)
    module.weight_u.copy_(left[:, 0])
    module.weight_v.copy_(right[0])
    return weight / singular_values[0]


def _parametrize(module: nn.Module, kind: str) -> torch.Tensor:
    """Register a ``kind`` parametrization of the module's weight; returns the weight it makes the module use."""
    if kind == 'spectral_norm_hook':
        return _hook_spectral_norm(module)
    if kind == 'parametrize':
        torch.nn.utils.parametrize.register_parametrization(module, 'weight', _Scale(1.5))
    else:
        torch.nn.utils.parametrizations.spectral_norm(module)
    return module.weight.detach()  # eval mode: no power iteration on this read


# Projections, fc2 and the conv shortcuts' convs (the stem's conv for timm's Swin, which has no shortcuts).
PARAMETRIZED = ('attn.proj', 'mlp.fc2', 'conv_shortcuts.0.dw', 'conv_shortcuts.0.pw', 'patch_embed.proj')


@pytest.mark.parametrize('kind', ['parametrize', 'spectral_norm', 'spectral_norm_hook'])
@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_a_parametrized_weight_is_the_weight_the_model_uses(name, form, kind):
    model = build(name, form).eval()
    targets = [n for n, _ in model.named_modules() if n.endswith(PARAMETRIZED)]
    assert targets
    with torch.no_grad():  # spectral init leaves norms at 1: scaled, spectral norm has something to normalise
        for n in targets:
            model.get_submodule(n).weight.mul_(3)
    unparametrized, reference = copy.deepcopy(model), copy.deepcopy(model)
    with torch.no_grad():
        for n in targets:
            reference.get_submodule(n).weight.copy_(_parametrize(model.get_submodule(n), kind))
        x = _images()
        out = model(x)
        expected = reference(x)
        assert (expected - unparametrized(x)).abs().max() > 1e-3  # the parametrization changes the output
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5 * expected.abs().max().item())


@pytest.mark.filterwarnings('ignore::DeprecationWarning')  # torch.ao.quantization points to torchao in new releases
@pytest.mark.parametrize(('name', 'form'), FORMS_WITH_CONTROL)
def test_quantize_dynamic_replaces_every_linear_and_keeps_the_logits(name, form):
    model = build(name, form).eval()
    linears = sorted(n for n, m in model.named_modules() if isinstance(m, nn.Linear))
    quantized = torch.ao.quantization.quantize_dynamic(copy.deepcopy(model), {nn.Linear}, dtype=torch.qint8)
    left = [n for n, m in quantized.named_modules() if isinstance(m, nn.Linear)]
    assert not left, f'nn.Linear layers quantize_dynamic did not replace: {left}'
    dynamic = sorted(n for n, m in quantized.named_modules() if isinstance(m, torch.ao.nn.quantized.dynamic.Linear))
    assert dynamic == linears
    x = _images(4)
    with torch.no_grad():
        similarity = F.cosine_similarity(quantized(x), model(x), dim=1)
    assert similarity.min() >= 0.98, similarity
