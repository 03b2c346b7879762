"""Autocast's weight casts made together (lipsformer.training.weight_casts): autocast's values and gradients, the
parameters back in place whatever happens in the block, and the training step that uses them."""
import os

import pytest
import timm
import torch
from forms_support import form
from safetensors.torch import load_file
from tiny_models import TINY_MODELS
from training_support import tiny_overrides

import lipsformer  # noqa: F401
from lipsformer.fastpath import set_fast_path
from lipsformer.training import load_config, train, weight_casts
from lipsformer.training.weight_casts import GroupedWeightCasts, refusal_reason


def _model(name: str) -> torch.nn.Module:
    torch.manual_seed(0)
    return timm.create_model(name, **TINY_MODELS[name], num_classes=5).train()


def _step(model: torch.nn.Module, images: torch.Tensor, casts: GroupedWeightCasts | None):
    """One CPU bf16 autocast forward and backward: the loss and every parameter's gradient."""
    model.zero_grad(set_to_none=True)
    torch.manual_seed(1)  # the same drop path in both steps
    with torch.autocast('cpu', dtype=torch.bfloat16), casts.applied('cpu') if casts else torch.autocast('cpu'):
        loss = model(images).float().logsumexp(-1).mean()
    loss.backward()
    return loss.detach(), {name: param.grad for name, param in model.named_parameters()}


@pytest.mark.parametrize('name', [*TINY_MODELS, 'swin_tiny_patch4_window7_224'])
def test_the_plain_graph_gives_autocast_s_loss_and_gradients_bit_for_bit(name):
    """Each weight cast together rounds as autocast's own cast of it, and its gradient arrives in float32 as
    autocast's cast backward gives it: the same bits, in every family and in timm's Swin."""
    kwargs = TINY_MODELS.get(name, dict(embed_dim=16, depths=(1, 1, 1, 1), num_heads=(1, 1, 1, 1), window_size=2,
                                        img_size=64))
    torch.manual_seed(0)
    model = timm.create_model(name, **kwargs, num_classes=5, drop_path_rate=0.1).train()
    images = torch.randn(2, 3, 64, 64)
    casts = GroupedWeightCasts(model)
    assert len(casts) == sum(1 for module in model.modules() if isinstance(module, (torch.nn.Linear, torch.nn.Conv2d))
                             for _ in module.parameters(recurse=False))
    with set_fast_path(False):
        loss, grads = _step(model, images, None)
        grouped_loss, grouped_grads = _step(model, images, casts)
    assert torch.equal(loss, grouped_loss)
    assert grads.keys() == grouped_grads.keys()
    for key, grad in grads.items():
        assert grouped_grads[key].dtype == torch.float32 and torch.equal(grad, grouped_grads[key]), key


@pytest.mark.parametrize('name', TINY_MODELS)
def test_the_fast_form_stays_within_bfloat16_s_rounding(name):
    """The fast form folds alpha into the projections' weights: with the weights cast beforehand it scales them in
    bfloat16, one more rounding than scaling in float32 and casting (the plain graph scales the output instead)."""
    model = _model(name)
    images = torch.randn(2, 3, 64, 64)
    casts = GroupedWeightCasts(model)
    with form(model, True):
        loss, grads = _step(model, images, None)
        grouped_loss, grouped_grads = _step(model, images, casts)
    torch.testing.assert_close(grouped_loss, loss, rtol=2e-2, atol=2e-2)
    for key, grad in grads.items():
        scale = grad.norm().clamp_min(1e-6)
        assert (grouped_grads[key] - grad).norm() / scale < 5e-2, key


@pytest.mark.parametrize('alpha_learnable', [True, False])
@pytest.mark.parametrize('name', TINY_MODELS)
def test_alphas_folded_into_the_casts_give_the_block_s_own_fold(name, alpha_learnable, monkeypatch):
    """Folded together a shape at a time, the projections' and fc2s' casts times their alphas are the products the
    block's own fold makes of the same casts: the same loss. The gradients agree to bfloat16's rounding: on the CPU
    the block's own fold (a lean Function) unscales a weight's gradient in float32 before rounding it, the group
    from the bfloat16 gradient, as autograd does on a GPU; an alpha's sum over a row may round otherwise too. (Both
    differ from the float32 fold by about 1%, the two from each other by about 0.3%.)"""
    torch.manual_seed(0)
    model = timm.create_model(name, **TINY_MODELS[name], num_classes=5, drop_path_rate=0.1,
                              alpha_learnable=alpha_learnable).train()
    with torch.no_grad():  # biases and alphas apart from their initial zeros and equal values
        for tensor in [*model.parameters(), *(alpha.gamma for alpha in model.modules() if hasattr(alpha, 'gamma'))]:
            tensor.add_(torch.randn_like(tensor) * 0.1)
    images = torch.randn(2, 3, 64, 64)
    with form(model, True):
        together_loss, together = _step(model, images, GroupedWeightCasts(model))
        monkeypatch.setattr(weight_casts, 'alpha_folds', lambda block: [])  # each block folds its own alphas
        own_loss, own = _step(model, images, GroupedWeightCasts(model))
    assert torch.equal(together_loss, own_loss)
    alphas = [name for name in own if name.endswith(('alpha1.gamma', 'alpha2.gamma'))]
    assert len(alphas) == (2 * sum(len(stage.blocks) for stage in model.stages) if alpha_learnable else 0)
    assert own.keys() == together.keys()
    for key, grad in own.items():
        assert together[key].dtype == torch.float32
        assert (together[key] - grad).norm() <= 2 ** -7 * grad.norm(), key


def test_a_folded_alpha_is_none_inside_the_block_and_back_after_it():
    model = _model('lipsformer_cswin_tiny')
    block = model.stages[0].blocks[0]
    gamma, weight = block.alpha2.gamma, block.mlp.fc2.weight
    with form(model, True), torch.autocast('cpu', dtype=torch.bfloat16), GroupedWeightCasts(model).applied('cpu'):
        assert block.alpha2.gamma is None
        expected = weight.to(torch.bfloat16) * gamma.to(torch.bfloat16).unsqueeze(-1)
        assert torch.equal(block.mlp.fc2.weight, expected)
    assert block.alpha2.gamma is gamma and block.mlp.fc2.weight is weight
    with torch.autocast('cpu', dtype=torch.bfloat16), GroupedWeightCasts(model).applied('cpu'):
        assert block.alpha2.gamma.dtype == torch.float32  # a plain block folds nothing


def test_layers_a_forward_does_not_reach_get_no_gradient_as_without_grouped_casts():
    """A stage's first block run alone, and only the conv shortcuts of its second: the folded layers of the second
    block (and of every other stage) get no gradient, as with autocast's own casts; the first block's the same."""
    model = _model('lipsformer_swin_tiny')
    first, second = model.stages[2].blocks
    x = torch.randn(2, 4, 4, first.norm2.dim)
    grads = []
    with form(model, True):
        for casts in (None, GroupedWeightCasts(model)):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(1)
            with torch.autocast('cpu', dtype=torch.bfloat16), casts.applied('cpu') if casts else torch.autocast('cpu'):
                y = first(x) + second.conv_shortcuts[0](x)
            y.float().sum().backward()
            grads.append({name: param.grad for name, param in model.named_parameters() if param.grad is not None})
    assert grads[0].keys() == grads[1].keys()
    assert 'stages.2.blocks.0.alpha2.gamma' in grads[0] and 'stages.2.blocks.1.mlp.fc2.weight' not in grads[0]
    for key, grad in grads[0].items():
        assert (grads[1][key] - grad).norm() <= 2 ** -7 * grad.norm(), key


def test_the_parameters_are_back_after_the_block_even_when_it_raises():
    model = _model('lipsformer_swin_tiny')
    casts = GroupedWeightCasts(model)
    qkv = model.stages[0].blocks[0].attn.qkv
    parameter = qkv.weight
    with torch.autocast('cpu', dtype=torch.bfloat16), casts.applied('cpu'):
        assert qkv.weight.dtype == torch.bfloat16 and not isinstance(qkv.weight, torch.nn.Parameter)
        assert qkv.weight.grad_fn is not None
    assert qkv.weight is parameter
    with pytest.raises(RuntimeError, match='inside'):
        with torch.autocast('cpu', dtype=torch.bfloat16), casts.applied('cpu'):
            raise RuntimeError('inside')
    assert qkv.weight is parameter and dict(model.named_parameters())['stages.0.blocks.0.attn.qkv.weight'] is parameter


def test_nothing_is_cast_outside_autocast_or_without_gradients():
    model = _model('lipsformer_cswin_tiny')
    casts = GroupedWeightCasts(model)
    qkv = model.stages[0].blocks[0].attn.qkv
    with casts.applied('cpu'):
        assert isinstance(qkv.weight, torch.nn.Parameter)
    with torch.no_grad(), torch.autocast('cpu', dtype=torch.bfloat16), casts.applied('cpu'):
        assert isinstance(qkv.weight, torch.nn.Parameter)


def test_gradients_accumulate_over_micro_batches_as_autocast_s():
    model = _model('lipsformer_cswin_tiny')
    casts = GroupedWeightCasts(model)
    images = torch.randn(2, 3, 64, 64)
    results = []
    for grouped in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(1)  # the same drop path
        with set_fast_path(False):
            for half in images.split(1):
                with torch.autocast('cpu', dtype=torch.bfloat16), \
                        casts.applied('cpu') if grouped else torch.autocast('cpu'):
                    model(half).float().sum().backward()
        results.append({name: param.grad.clone() for name, param in model.named_parameters()})
    assert all(torch.equal(results[0][key], results[1][key]) for key in results[0])


def test_gradient_checkpointing_and_sharding_are_refused_with_the_reason():
    model = _model('lipsformer_swin_tiny')
    assert refusal_reason(model) is None
    model.set_grad_checkpointing(True)
    assert 'gradient checkpointing' in refusal_reason(model)


@pytest.mark.usefixtures('fresh_accelerator')
def test_a_bf16_training_run_casts_together_and_trains_the_same_weights(data_dir, tmp_path, monkeypatch, caplog):
    """train.grouped_weight_casts (on by default) in a CPU bf16 run: each micro-batch's forward casts the weights
    together, and the run's weights equal those of the same run casting each weight at its use; with gradient
    checkpointing the run says that autocast casts them instead."""
    entered = []
    applied = GroupedWeightCasts.applied

    def counting(self, device_type):
        entered.append(device_type)
        return applied(self, device_type)
    monkeypatch.setattr(GroupedWeightCasts, 'applied', counting)
    settings = {'train.mixed_precision': 'bf16', 'train.epochs': 1, 'model.drop_path_rate': 0.0,
                'augment.reprob': 0.0, 'ema.enabled': False}
    weights = {}
    with set_fast_path(False):
        for grouped in (True, False):
            run_dir = str(tmp_path / str(grouped))
            summary = train(load_config(None, tiny_overrides(data_dir, **settings, **{
                'train.grouped_weight_casts': grouped})), run_dir)
            assert summary['status'] == 'finished'
            if grouped:
                assert entered and set(entered) == {'cpu'}
                entered.clear()
            else:
                assert not entered
            weights[grouped] = load_file(os.path.join(run_dir, 'export', 'last', 'model.safetensors'))
    assert all(torch.equal(weights[True][key], weights[False][key]) for key in weights[True])
    train(load_config(None, tiny_overrides(data_dir, **settings, **{'model.grad_checkpointing': True})),
          str(tmp_path / 'checkpointed'))
    assert not entered and 'gradient checkpointing recomputes the forward' in caplog.text
