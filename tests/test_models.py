"""timm parity: everything timm's own model tests check, plus LipsFormer-specific architecture facts."""
import math

import pytest
import timm
import torch
from forms_support import form
from timm.layers import set_fused_attn
from timm.optim import create_optimizer_v2
from tiny_models import TINY_MODELS

from lipsformer import LipsFormerCSwin, LipsFormerSwin
from lipsformer.layers import CenterNorm, ResidualAlpha, ScaledCosineAttention

ALL_MODELS = timm.list_models('lipsformer*')

# Parameters of the authors' code, 1000 classes (CSwin S/B built with the paper's shapes and counted).
PAPER_PARAMS = {
    'lipsformer_swin_tiny': 30.91e6, 'lipsformer_swin_small': 54.48e6, 'lipsformer_swin_base': 96.01e6,
    'lipsformer_swin_large': 214.13e6, 'lipsformer_swin_large_plus': 478.91e6, 'lipsformer_cswin_tiny': 23.78e6,
    'lipsformer_cswin_small': 37.51e6, 'lipsformer_cswin_base': 83.05e6,
}


def _tiny(name, **kwargs):
    return timm.create_model(name, **dict(TINY_MODELS[name], **kwargs))


def test_every_model_is_registered_with_its_pretrained_cfg():
    expected = {f'lipsformer_swin_{v}' for v in ('tiny', 'small', 'base', 'large', 'large_plus', 'base_384',
                                                  'large_384')}
    expected |= {f'lipsformer_cswin_{v}' for v in ('tiny', 'small', 'base', 'base_384')}
    assert set(ALL_MODELS) == expected
    for name in ALL_MODELS:
        cfg = timm.get_pretrained_cfg(name).to_dict()
        assert cfg['paper_ids'] == 'arXiv:2304.09856' and cfg['interpolation'] == 'bicubic'
        assert cfg['mean'] == timm.data.IMAGENET_DEFAULT_MEAN and cfg['std'] == timm.data.IMAGENET_DEFAULT_STD
        assert cfg['crop_pct'] == (1.0 if name.endswith('384') else 0.875)
        assert cfg['origin_url'] and cfg['license'] and cfg['first_conv'] and cfg['classifier']
    assert timm.list_pretrained('lipsformer*') == ['lipsformer_swin_tiny.in1k']
    assert 'lipsformer-swin-tiny.pth' in timm.get_pretrained_cfg('lipsformer_swin_tiny.in1k').url


@pytest.mark.parametrize('name', sorted(PAPER_PARAMS))
def test_parameter_count_matches_the_authors_code(name):
    with torch.device('meta'):
        model = timm.create_model(name)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(PAPER_PARAMS[name], rel=5e-3)


def test_large_plus_with_the_imagenet22k_head():
    with torch.device('meta'):
        model = timm.create_model('lipsformer_swin_large_plus', num_classes=21841)
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(526.95e6, rel=5e-3)


def test_defaults_reproduce_the_authors_architecture():
    swin = timm.create_model('lipsformer_swin_tiny')
    block = swin.stages[2].blocks[0]
    assert isinstance(block.norm1, CenterNorm) and isinstance(block.norm2, CenterNorm)
    assert isinstance(swin.norm, CenterNorm)
    assert all(torch.all(m.gamma == 1 / 12) for m in swin.modules() if isinstance(m, ResidualAlpha))
    assert all(m.tau_init == 10.0 and not m.v_norm for m in swin.modules() if isinstance(m, ScaledCosineAttention))
    assert all(b.attn.shift_size == (0, 0) for s in swin.stages for b in s.blocks)
    assert [s.blocks[0].attn.window_size for s in swin.stages] == [(7, 7)] * 4
    rates = [b.drop_path1.drop_prob for s in swin.stages for b in s.blocks]
    assert rates == pytest.approx(torch.linspace(0, 0.2, 12).tolist())

    cswin = timm.create_model('lipsformer_cswin_tiny')
    block = cswin.stages[2].blocks[0]
    assert isinstance(block.norm1, torch.nn.Identity) and isinstance(block.norm2, CenterNorm)
    assert isinstance(cswin.norm, torch.nn.Identity)
    assert all(torch.all(m.gamma == 0.2) for m in cswin.modules() if isinstance(m, ResidualAlpha))
    assert all(m.tau_init == 12.0 for m in cswin.modules() if isinstance(m, ScaledCosineAttention))
    assert [s.blocks[0].attn.two_branches for s in cswin.stages] == [True, True, True, False]
    assert block.attn.branches[0].head_scale == pytest.approx(1 / math.sqrt(4))
    assert cswin.stages[3].blocks[0].attn.branches[0].head_scale == pytest.approx(1 / 4)
    linears = [m for m in _tiny('lipsformer_cswin_tiny').modules() if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d))]
    norms = [torch.linalg.matrix_norm(m.weight.reshape(m.weight.shape[0], -1), ord=2).item() for m in linears]
    assert norms == pytest.approx([1.0] * len(norms), rel=1e-4)  # spectral init on every Linear and Conv


def test_384_variants_use_their_windows_and_stripes():
    with torch.device('meta'):
        swin = timm.create_model('lipsformer_swin_base_384')
        cswin = timm.create_model('lipsformer_cswin_base_384')
    assert [s.blocks[0].attn.window_size for s in swin.stages] == [(12, 12)] * 4
    assert [s.blocks[0].attn.split_size for s in cswin.stages] == [1, 2, 12, 12]
    assert swin.pretrained_cfg['input_size'] == (3, 384, 384)


@pytest.mark.parametrize('name', TINY_MODELS)
def test_forward_backward_every_parameter_gets_a_gradient(name):
    model = _tiny(name, num_classes=42).train()
    out = model(torch.randn(2, 3, 64, 64))
    assert out.shape == (2, 42)
    out.mean().backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    assert not missing


@pytest.mark.parametrize('name', TINY_MODELS)
def test_timm_default_cfg_interface(name):
    model = _tiny(name).eval()
    x = torch.randn(1, 3, 64, 64)
    features = model.forward_features(x)
    assert model.output_fmt == 'NHWC' and features.shape == (1, 2, 2, model.num_features)
    pre_logits = model.forward_head(features, pre_logits=True)
    assert pre_logits.shape == (1, model.head_hidden_size)
    state_dict = model.state_dict()
    assert model.pretrained_cfg['first_conv'] + '.weight' in state_dict
    assert model.pretrained_cfg['classifier'] + '.weight' in state_dict
    assert model.get_classifier() is model.head.fc
    model.reset_classifier(0)
    torch.testing.assert_close(model(x), pre_logits)
    model.reset_classifier(0, '')
    assert model(x).shape == features.shape
    model.reset_classifier(7, 'avg')
    assert model(x).shape == (1, 7)
    unpooled = timm.create_model(name, num_classes=0, global_pool='', **TINY_MODELS[name]).eval()
    assert unpooled(x).shape == features.shape


@pytest.mark.parametrize('name', TINY_MODELS)
def test_features_only_gives_nchw_maps_at_strides_4_to_32(name):
    model = timm.create_model(name, features_only=True, **TINY_MODELS[name]).eval()
    assert model.feature_info.reduction() == [4, 8, 16, 32]
    outputs = model(torch.randn(1, 3, 96, 64))
    assert [o.shape for o in outputs] == [
        (1, c, 96 // r, 64 // r) for c, r in zip(model.feature_info.channels(), [4, 8, 16, 32])]
    selected = timm.create_model(name, features_only=True, out_indices=(1, 3), **TINY_MODELS[name])
    assert selected.feature_info.reduction() == [8, 32]


@pytest.mark.parametrize('name', TINY_MODELS)
def test_forward_intermediates_prune_and_grad_checkpointing(name):
    model = _tiny(name).eval()
    x = torch.randn(1, 3, 64, 64)
    final, intermediates = model.forward_intermediates(x)
    torch.testing.assert_close(final, model.forward_features(x))
    assert [i.shape[1] for i in intermediates] == [16, 32, 64, 128]
    only = model.forward_intermediates(x, indices=[1], intermediates_only=True, stop_early=True)
    torch.testing.assert_close(only[0], intermediates[1])
    model.set_grad_checkpointing(True)
    torch.testing.assert_close(model.forward_intermediates(x)[0], final)
    model.train()
    torch.manual_seed(0)
    with_ckpt = model(x)
    model.set_grad_checkpointing(False)
    torch.manual_seed(0)
    torch.testing.assert_close(with_ckpt, model(x))
    pruned = _tiny(name).eval()
    pruned.load_state_dict(model.state_dict())
    assert pruned.prune_intermediate_layers([1]) == [1]
    assert len(pruned.stages) == 2 and pruned.num_features == 32
    torch.testing.assert_close(pruned.forward_intermediates(x, indices=[1], intermediates_only=True)[0],
                               intermediates[1])


def test_optimizer_hooks():
    model = _tiny('lipsformer_swin_tiny')
    no_decay = model.no_weight_decay()
    assert no_decay and all('relative_position_bias_table' in n for n in no_decay)
    assert _tiny('lipsformer_cswin_tiny', tau_learnable=True).no_weight_decay() == {
        n for n, _ in _tiny('lipsformer_cswin_tiny', tau_learnable=True).named_parameters() if n.endswith('.tau')}
    groups = timm.models.group_parameters(model, model.group_matcher())
    assert len(groups) == 2 + sum(len(s.blocks) for s in model.stages) + 0  # stem, blocks, final norm
    optimizer = create_optimizer_v2(model, 'adamw', lr=1e-3, weight_decay=0.05, layer_decay=0.9)
    no_decay_params = {id(p) for g in optimizer.param_groups if g['weight_decay'] == 0 for p in g['params']}
    named = dict(model.named_parameters())
    assert all(id(named[n]) in no_decay_params for n in no_decay)
    assert id(named['stages.0.blocks.0.alpha1.gamma']) in no_decay_params  # 1-D, as the authors' no-decay group


@pytest.mark.parametrize('name', TINY_MODELS)
@pytest.mark.parametrize('size', [(64, 64), (96, 64), (32, 160)])
def test_any_multiple_of_32_works_without_rebuilding(name, size):
    model = _tiny(name).eval()
    out = model.forward_features(torch.randn(1, 3, *size))
    assert out.shape == (1, size[0] // 32, size[1] // 32, model.num_features)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize('name', TINY_MODELS)
def test_bad_inputs_raise_value_errors_naming_the_problem(name):
    model = _tiny(name)
    with pytest.raises(ValueError, match=r'multiples of 32, got 65x64'):
        model(torch.randn(1, 3, 65, 64))
    with pytest.raises(ValueError, match=r'expected 3 input channels, got 1'):
        model(torch.randn(1, 1, 64, 64))
    with pytest.raises(ValueError, match=r'4-D image batch.*\[3, 64, 64\]'):
        model(torch.randn(3, 64, 64))
    with pytest.raises(ValueError, match='img_size must be a multiple of 32'):
        _tiny(name, img_size=100)


def test_set_input_size_retargets_the_default():
    model = _tiny('lipsformer_swin_tiny')
    model.set_input_size(128)
    assert model.patch_embed.img_size == (128, 128)
    with pytest.raises(ValueError, match='multiple of 32'):
        model.set_input_size(120)


def test_cswin_padded_stripes_equal_a_narrower_stripe():
    """With key masking, a stripe cut by the border gives the same result as attending over its valid tokens."""
    from lipsformer.models.lipsformer_cswin import StripeAttention
    branch = StripeAttention(8, 2, ScaledCosineAttention(tau=12.0)).eval()
    qkv = torch.randn(1, 6, 5, 24).unflatten(-1, (3, 8))  # q, k, v of 8 channels
    torch.testing.assert_close(branch(qkv, 6, 7), branch(qkv, 6, 5))  # one 6x7 stripe over a 6x5 map


def test_swin_shifted_windows_option():
    plain = _tiny('lipsformer_swin_tiny', window_size=2).eval()
    shifted = _tiny('lipsformer_swin_tiny', window_size=2, shift_windows=True).eval()
    shifted.load_state_dict(plain.state_dict())
    assert [b.attn.shift_size for b in shifted.stages[2].blocks] == [(0, 0), (1, 1)]
    x = torch.randn(1, 3, 64, 64)
    assert not torch.allclose(plain(x), shifted(x))
    assert shifted.stages[3].blocks[0].attn.shift_size == (0, 0)  # the 2x2 last stage fits one window


def test_paper_options_and_swappable_components():
    model = _tiny('lipsformer_cswin_tiny', v_norm=True, nu=0.5, tau=5.0, tau_learnable=True, alpha_init=0.1,
                  norm_layer='layer', attn_type='dot', weight_init='xavier', conv_config='B')
    assert isinstance(model.stages[0].blocks[0].norm2, torch.nn.LayerNorm)
    assert len(model.stages[0].blocks[0].conv_shortcuts) == 1
    assert torch.all(model.stages[0].blocks[0].alpha1.gamma == 0.1)
    assert torch.isfinite(model(torch.randn(1, 3, 64, 64))).all()
    scsa = _tiny('lipsformer_swin_tiny', v_norm=True, nu=0.5, tau=5.0, tau_learnable=True)
    kernels = [m for m in scsa.modules() if isinstance(m, ScaledCosineAttention)]
    assert all(k.v_norm and k.nu == 0.5 and k.tau.item() == 5.0 for k in kernels)
    with pytest.raises(ValueError, match='attn_type'):
        _tiny('lipsformer_swin_tiny', attn_type='linear')


@pytest.mark.parametrize('name', TINY_MODELS)
def test_pre_norm_puts_a_norm_at_the_input_of_each_branch_and_before_the_head(name):
    model = _tiny(name, norm_position='pre', norm_layer='layer').eval()
    block = model.stages[1].blocks[0]
    assert isinstance(block.norm1, torch.nn.LayerNorm) and isinstance(block.norm2, torch.nn.LayerNorm)
    assert isinstance(model.norm, torch.nn.LayerNorm)
    seen = {}
    block.register_forward_hook(lambda module, args, out: seen.update(block_in=args[0], block_out=out))
    block.attn.register_forward_hook(lambda module, args, out: seen.update(attn_in=args[0]))
    with torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
        x = seen['block_in']
        for shortcut in block.conv_shortcuts:
            x = shortcut(x)
        torch.testing.assert_close(seen['attn_in'], block.norm1(x))  # the attention reads the normed stream
        x = x + block.alpha1(block.attn(block.norm1(x)))
        torch.testing.assert_close(seen['block_out'], x + block.alpha2(block.mlp(block.norm2(x))))


def test_norm_position_post_keeps_the_default_architecture_and_state_dict():
    default, post = _tiny('lipsformer_cswin_tiny'), _tiny('lipsformer_cswin_tiny', norm_position='post')
    assert list(default.state_dict()) == list(post.state_dict())
    assert isinstance(post.stages[0].blocks[0].norm1, torch.nn.Identity) and isinstance(post.norm, torch.nn.Identity)
    with pytest.raises(ValueError, match="'post', 'pre'"):
        _tiny('lipsformer_cswin_tiny', norm_position='sandwich')


@pytest.mark.parametrize('name', TINY_MODELS)
def test_fixed_alpha_is_a_buffer_that_an_optimizer_step_leaves_alone(name):
    model = _tiny(name, alpha_init=1.0, alpha_learnable=False)
    scales = [m for m in model.modules() if isinstance(m, ResidualAlpha)]
    block = model.stages[0].blocks[0]
    assert block.alpha1 in scales and block.conv_shortcuts[0].alpha in scales
    assert not any(isinstance(s.gamma, torch.nn.Parameter) for s in scales)
    assert not any('alpha' in n for n, _ in model.named_parameters())
    assert set(_tiny(name).state_dict()) == set(model.state_dict())  # still saved, under the same keys
    optimizer = create_optimizer_v2(model, 'adamw', lr=0.1)
    model(torch.randn(1, 3, 64, 64)).sum().backward()
    optimizer.step()
    assert all(torch.all(s.gamma == 1.0) for s in scales)


def _kernels(model):
    return [m for m in model.modules() if isinstance(m, ScaledCosineAttention)]


@pytest.mark.parametrize('name', TINY_MODELS)
def test_fused_attention_equals_explicit_path(name):
    x = torch.randn(2, 3, 64, 96)
    with torch.no_grad():
        set_fused_attn(False)
        try:
            explicit_model = _tiny(name).eval()
        finally:
            set_fused_attn(True)
        fused_model = _tiny(name).eval()
        fused_model.load_state_dict(explicit_model.state_dict())
        assert all(k.fused_attn for k in _kernels(fused_model))
        assert not any(k.fused_attn for k in _kernels(explicit_model))
        torch.testing.assert_close(fused_model(x), explicit_model(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize('name', TINY_MODELS)
def test_torchscript(name):
    with timm.set_scriptable(True):
        model = _tiny(name).eval()
    x = torch.randn(1, 3, 64, 96)
    torch.testing.assert_close(torch.jit.script(model)(x), model(x))


@pytest.mark.parametrize('fast', [True, False])
@pytest.mark.parametrize('name', TINY_MODELS)
def test_fx_trace_gives_eager_bits(name, fast):
    """timm's test_model_forward_fx: the model traced by timm's FX tracer (its leaf modules and autowrapped
    functions) gives exactly eager's output, with the fast path on (the block is a leaf, so the traced graph runs its
    fast form) and off."""
    from timm.models import get_notrace_functions, get_notrace_modules
    from torchvision.models.feature_extraction import create_feature_extractor, get_graph_node_names
    model = _tiny(name).eval()
    tracer_kwargs = dict(leaf_modules=get_notrace_modules(), autowrap_functions=get_notrace_functions(),
                         param_shapes_constant=True)
    _, eval_nodes = get_graph_node_names(model, tracer_kwargs=tracer_kwargs)
    fx_model = create_feature_extractor(model, return_nodes=[eval_nodes[-1]], tracer_kwargs=tracer_kwargs)
    x = torch.randn(2, 3, 64, 64)
    with form(model, fast), torch.no_grad():
        assert torch.equal(next(iter(fx_model(x).values())), model(x))


@pytest.mark.parametrize('grad_enabled', [True, False])  # the lean Functions, and the plain expressions
@pytest.mark.parametrize('name', TINY_MODELS)
def test_torch_compile_has_no_graph_breaks(name, grad_enabled):
    torch._dynamo.reset()
    model = _tiny(name).eval()
    with torch.set_grad_enabled(grad_enabled):
        explanation = torch._dynamo.explain(model)(torch.randn(1, 3, 64, 64))
    assert explanation.graph_break_count == 0, explanation.break_reasons


@pytest.mark.parametrize('name', TINY_MODELS)
def test_onnx_export_with_dynamic_batch_matches_onnxruntime(name, tmp_path):
    onnxruntime = pytest.importorskip('onnxruntime')
    model = _tiny(name).eval()
    path = tmp_path / 'model.onnx'
    torch.onnx.export(model, (torch.randn(2, 3, 64, 64),), str(path), input_names=['x'], output_names=['logits'],
                      dynamic_axes={'x': {0: 'batch'}, 'logits': {0: 'batch'}}, dynamo=False)
    x = torch.randn(3, 3, 64, 64)
    session = onnxruntime.InferenceSession(str(path), providers=['CPUExecutionProvider'])
    (logits,) = session.run(None, {'x': x.numpy()})
    torch.testing.assert_close(torch.from_numpy(logits), model(x).detach(), atol=1e-4, rtol=1e-4)


def test_model_classes_are_exported():
    assert isinstance(_tiny('lipsformer_swin_tiny'), LipsFormerSwin)
    assert isinstance(_tiny('lipsformer_cswin_tiny'), LipsFormerCSwin)


@pytest.mark.parametrize('fast', [True, False])
@pytest.mark.parametrize('name', TINY_MODELS)
def test_every_depthwise_conv_and_linear_layer_gets_a_contiguous_nhwc_map(name, fast):
    """The stem's output is made contiguous NHWC, so that no block inherits the permuted layout of timm's PatchEmbed
    (CenterNorm keeps a layout): on CUDA a channels-first depthwise conv runs a slow kernel of its own, and a linear
    layer copies a non-contiguous input first."""
    model = _tiny(name).eval()
    layouts = []

    names = {module: path for path, module in model.named_modules()}

    def record(module, args):
        conv = isinstance(module, torch.nn.Conv2d)  # an NCHW view of an NHWC map; a linear layer takes the map itself
        layout = torch.channels_last if conv else torch.contiguous_format
        layouts.append((names[module], args[0].is_contiguous(memory_format=layout)))

    for module in model.modules():
        if isinstance(module, torch.nn.Conv2d) and module.groups == module.in_channels > 1 or isinstance(
                module, torch.nn.Linear):
            module.register_forward_pre_hook(record)
    with form(model, fast), torch.no_grad():
        model(torch.randn(2, 3, 64, 64))
    assert len(layouts) > 10 and [path for path, ok in layouts if not ok] == []
