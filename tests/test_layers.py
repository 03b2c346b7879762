"""The Lipschitz building blocks against first principles and the paper's formulas (LipsFormer section 4.1,
Theorems 1-2, Appendix J)."""
import pytest
import torch
import torch.nn as nn
from torch.autograd.functional import jacobian

from lipsformer.fastpath import blocks, l2_normalize
from lipsformer.fastpath.lean_autograd import scaled_linear
from lipsformer.layers import (
    CenterNorm,
    ConvShortcut,
    DotProductAttention,
    ResidualAlpha,
    ScaledCosineAttention,
    create_conv_shortcuts,
    init_weights_,
    pad_to_multiple,
    padding_key_mask,
    resolve_norm_layer,
    spectral_norm,
    spectral_normalize_,
    window_partition,
    window_reverse,
)
from lipsformer.layers import softmax_attention as softmax_attention_module
from lipsformer.layers.softmax_attention import softmax_attention


def _sigma_max(matrix: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(matrix, ord=2).item()


@pytest.mark.parametrize('dim', [4, 64])
def test_center_norm_jacobian_norm_is_d_over_d_minus_1(dim):
    norm = CenterNorm(dim).double()
    for scale in (1e-6, 1.0, 1e3):
        x = torch.randn(dim, dtype=torch.float64) * scale
        assert _sigma_max(jacobian(norm, x)) == pytest.approx(dim / (dim - 1), rel=1e-12)
    assert norm.lipschitz_constant() == pytest.approx(dim / (dim - 1))
    if dim == 64:
        assert dim / (dim - 1) == pytest.approx(1.0159, abs=1e-4)


def test_center_norm_matches_formula_and_ignores_constant_shift():
    norm = CenterNorm(8)
    nn.init.normal_(norm.weight)
    nn.init.normal_(norm.bias)
    x = torch.randn(3, 5, 8)
    expected = norm.weight * 8 / 7 * (x - x.mean(-1, keepdim=True)) + norm.bias
    torch.testing.assert_close(norm(x), expected)
    torch.testing.assert_close(norm(x + 3.7), norm(x), atol=1e-5, rtol=0)


@pytest.mark.parametrize('dtype, std, tolerance', [
    (torch.float32, 1.0, 1e-6), (torch.float32, 1e4, 1e-6), (torch.float64, 1e3, 1e-12),
    (torch.bfloat16, 1.0, 1e-2), (torch.float16, 1.0, 2e-3)])
def test_center_norm_through_layer_norm_equals_the_centring_expression(dtype, std, tolerance):
    """CenterNorm runs on LayerNorm's fused kernel with eps = 2^60 (float16 keeps the plain expression): values and
    every gradient equal gamma D / (D - 1) (x - mean) + beta computed directly, from unit-scale activations to 1e4."""
    torch.manual_seed(0)
    norm = CenterNorm(48).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
        norm.bias.normal_()
    x = (torch.randn(4, 7, 48) * std + 3.0 * std).to(dtype).requires_grad_()
    out = norm(x)
    expected = torch.addcmul(norm.bias, x - x.mean(-1, keepdim=True), norm.weight * norm.scale)
    assert out.dtype == dtype and torch.isfinite(out).all()
    scale = expected.detach().abs().max()
    torch.testing.assert_close(out / scale, expected / scale, rtol=0, atol=tolerance)
    upstream = torch.randn_like(out)
    params = [x, norm.weight, norm.bias]
    for got, want in zip(torch.autograd.grad((out * upstream).sum(), params),
                         torch.autograd.grad((expected * upstream).sum(), params), strict=True):
        grad_scale = want.abs().max()
        torch.testing.assert_close(got / grad_scale, want / grad_scale, rtol=0, atol=tolerance * 10)


def test_layer_norm_blows_up_near_constant_input_where_center_norm_does_not():
    dim = 16
    x = torch.ones(dim, dtype=torch.float64) + 1e-9 * torch.randn(dim, dtype=torch.float64)
    layer_norm = nn.LayerNorm(dim, eps=1e-5).double()
    assert _sigma_max(jacobian(layer_norm, x)) == pytest.approx(1e-5 ** -0.5, rel=1e-3)  # ~316
    assert _sigma_max(jacobian(CenterNorm(dim).double(), x)) == pytest.approx(dim / (dim - 1))


def test_norm_factory():
    assert isinstance(resolve_norm_layer('center')(8), CenterNorm)
    assert isinstance(resolve_norm_layer('layer')(8), nn.LayerNorm)
    assert isinstance(resolve_norm_layer('none')(8), nn.Identity)
    with pytest.raises(ValueError, match='batch'):
        resolve_norm_layer('batch')


def test_weighted_residual_lipschitz_bound():
    dim = 6
    alpha = ResidualAlpha(dim, 0.3)
    nn.init.uniform_(alpha.gamma, -0.5, 0.5)
    linear = nn.Linear(dim, dim).double()
    spectral_normalize_(linear.weight.data)  # a 1-Lipschitz branch
    alpha = alpha.double()
    block = lambda x: x + alpha(linear(x))  # noqa: E731
    x = torch.randn(dim, dtype=torch.float64)
    assert _sigma_max(jacobian(block, x)) <= 1 + alpha.gamma.abs().max().item() + 1e-12
    fixed = ResidualAlpha(dim, 1.0, learnable=False)
    assert not list(fixed.parameters()) and 'gamma' in fixed.state_dict()


def test_spectral_norm_equals_the_largest_singular_value():
    for shape in [(7, 30), (30, 7), (24, 1, 7, 7), (5, 5)]:
        weight = torch.randn(shape, dtype=torch.float64)
        expected = torch.linalg.svdvals(weight.reshape(shape[0], -1))[0]
        assert spectral_norm(weight).item() == pytest.approx(expected.item(), rel=1e-12)


def test_spectral_init_gives_unit_spectral_norm_to_every_linear_and_conv():
    layers = [nn.Linear(96, 288), nn.Conv2d(24, 24, 7, groups=24), nn.Conv2d(3, 24, 4, stride=4), nn.Conv2d(8, 8, 1)]
    for layer in layers:
        init_weights_(layer, 'spectral')
        assert _sigma_max(layer.weight.reshape(layer.weight.shape[0], -1)) == pytest.approx(1.0, rel=1e-5)
    assert torch.all(layers[0].bias == 0)
    init_weights_(layers[0], 'trunc_normal')
    assert layers[0].weight.std().item() == pytest.approx(0.02, rel=0.15)
    with pytest.raises(ValueError, match='orthogonal'):
        init_weights_(layers[0], 'orthogonal')


def _random_qkv(batch=2, heads=3, tokens=10, head_dim=8, scale=1.0):
    return [torch.randn(batch, heads, tokens, head_dim, dtype=torch.float64) * scale for _ in range(3)]


@pytest.mark.parametrize('tau_learnable', [False, True])
@pytest.mark.parametrize('v_norm', [False, True])
def test_scsa_fused_equals_explicit_path(tau_learnable, v_norm):
    attn = ScaledCosineAttention(tau=10.0, tau_learnable=tau_learnable, v_norm=v_norm, nu=0.7).double()
    q, k, v = _random_qkv()
    bias = torch.randn(1, 3, 10, 10, dtype=torch.float64)
    attn.fused_attn = True
    fused = attn(q, k, v, bias)
    attn.fused_attn = False
    explicit = attn(q, k, v, bias)
    torch.testing.assert_close(fused, explicit, atol=1e-10, rtol=0)
    qn, kn = nn.functional.normalize(q, dim=-1), nn.functional.normalize(k, dim=-1)
    vv = nn.functional.normalize(v, dim=-1) if v_norm else v
    reference = torch.softmax(10.0 * qn @ kn.transpose(-1, -2) + bias, -1) @ vv * (0.7 if v_norm else 1.0)
    torch.testing.assert_close(explicit, reference)


@pytest.mark.parametrize('bias_shape', [None, (4, 1, 1, 10), (4, 3, 10, 10), (1, 4, 1, 10, 10), (2, 4, 1, 1, 10),
                                        (3, 10, 10)])
def test_fused_attention_over_windows_gives_sdpa_4d_tensors_and_the_explicit_values(bias_shape, monkeypatch):
    """(B, windows, heads, tokens, head_dim) inputs with a per-window bias, as the windowed models call it: SDPA sees
    4-D tensors (its fused CUDA kernels and ONNX's operator take no others) and the values are the definition's."""
    q, k, v = (t.unflatten(0, (2, 4)) for t in _random_qkv(batch=8))
    bias = None if bias_shape is None else torch.randn(bias_shape, dtype=torch.float64)
    ranks, sdpa = [], nn.functional.scaled_dot_product_attention

    def spy(query, key, value, **kwargs):
        ranks.append((query.dim(), key.dim(), value.dim(), None if kwargs['attn_mask'] is None
                      else kwargs['attn_mask'].dim()))
        return sdpa(query, key, value, **kwargs)

    monkeypatch.setattr(softmax_attention_module.F, 'scaled_dot_product_attention', spy)
    with torch.no_grad():
        fused = softmax_attention(q, k, v, bias, 0.0, True, 0.5)
    assert ranks == [(4, 4, 4, None if bias is None else 4)]
    reference = torch.softmax(0.5 * q @ k.transpose(-1, -2) + (0.0 if bias is None else bias), -1) @ v
    torch.testing.assert_close(fused, reference, atol=1e-12, rtol=0)


def test_scsa_logits_are_bounded_whatever_the_input_scale():
    attn = ScaledCosineAttention(tau=12.0, v_norm=True, nu=1.0).double()
    for scale in (1e-3, 1.0, 1e4):
        q, k, v = _random_qkv(scale=scale)
        out = attn(q, k, v)
        assert out.norm(dim=-1).max() <= 1.0 + 1e-12  # rows are convex combinations of unit vectors, times nu


def test_dot_product_attention_matches_definition():
    attn = DotProductAttention(head_dim=8).double()
    q, k, v = _random_qkv()
    reference = torch.softmax(q @ k.transpose(-1, -2) / 8 ** 0.5, -1) @ v
    for fused in (True, False):
        attn.fused_attn = fused
        torch.testing.assert_close(attn(q, k, v), reference)


def test_conv_shortcut_configurations():
    assert [len(create_conv_shortcuts(8, c, 0.1, 0.0)) for c in 'ABCD'] == [0, 1, 1, 2]
    assert [s.pw is not None for s in create_conv_shortcuts(8, 'D', 0.1, 0.0)] == [True, False]
    with pytest.raises(ValueError, match='conv_config'):
        create_conv_shortcuts(8, 'E', 0.1, 0.0)
    shortcut = ConvShortcut(8, pointwise=True, alpha_init=0.2)
    x = torch.randn(2, 5, 6, 8)
    nchw = x.permute(0, 3, 1, 2)
    branch = shortcut.act2(shortcut.pw(shortcut.act1(shortcut.dw(nchw)))).permute(0, 2, 3, 1)
    torch.testing.assert_close(shortcut(x), x + 0.2 * branch)


def test_window_partition_round_trip_and_padding():
    x = torch.randn(2, 10, 13, 4)
    padded = pad_to_multiple(x, 4, 5)
    assert padded.shape == (2, 12, 15, 4)
    torch.testing.assert_close(padded[:, :10, :13], x)
    assert padded[:, 10:].abs().sum() == 0 and padded[:, :, 13:].abs().sum() == 0
    windows = window_partition(padded, 4, 5)
    assert windows.shape == (2 * 3 * 3, 20, 4)
    torch.testing.assert_close(windows[1].view(4, 5, 4), padded[0, 0:4, 5:10])
    torch.testing.assert_close(window_reverse(windows, 4, 5, 12, 15), padded)


def test_padding_key_mask_hides_exactly_the_padded_tokens():
    assert padding_key_mask(8, 8, 4, 4, torch.device('cpu'), torch.float32) is None
    mask = padding_key_mask(5, 3, 5, 2, torch.device('cpu'), torch.float64)  # windows 5x2 over a 5x4 map
    assert mask.shape == (2, 1, 1, 10) and mask.dtype == torch.float64  # one per window, the same for every image
    masked = torch.isinf(mask[1, 0, 0]).view(5, 2)  # the second window holds column 2 and padded column 3
    assert masked[:, 1].all() and not masked[:, 0].any()
    assert not torch.isinf(mask[0]).any()


def test_alpha_folded_into_the_last_linear_equals_scaling_its_output():
    """scaled_linear / the fast MLP: (alpha W) x + alpha b == alpha (W x + b), values and every gradient."""
    from timm.layers import Mlp
    torch.manual_seed(0)
    mlp = Mlp(8, 32)
    alpha = nn.Parameter(torch.rand(8) + 0.1)
    x = torch.randn(2, 5, 8, requires_grad=True)
    assert blocks.mlp_is_plain(mlp)
    folded = blocks.mlp(mlp, x, alpha)
    grads_folded = torch.autograd.grad(folded.square().sum(), [x, alpha, *mlp.parameters()])
    plain = mlp(x) * alpha
    grads_plain = torch.autograd.grad(plain.square().sum(), [x, alpha, *mlp.parameters()])
    torch.testing.assert_close(folded, plain, rtol=1e-6, atol=1e-6)
    for got, expected in zip(grads_folded, grads_plain, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)
    no_bias = nn.Linear(8, 3, bias=False)
    torch.testing.assert_close(scaled_linear(x, no_bias.weight, None, alpha[:3]), no_bias(x) * alpha[:3])
    assert torch.equal(scaled_linear(x, no_bias.weight, None), no_bias(x))


@pytest.mark.parametrize('drop_prob', [0.0, 0.5])
@pytest.mark.parametrize('training', [True, False])
@pytest.mark.parametrize('with_scale', [True, False])
def test_fused_weighted_residual_equals_timm_drop_path_of_the_scaled_branch(drop_prob, training, with_scale):
    """The fast path's x + DropPath(y * alpha) == x + timm DropPath(y * alpha) with the same seed: the same samples
    dropped, kept ones rescaled by 1 / keep_prob, and the same values and gradients."""
    from timm.layers import DropPath
    x = torch.randn(6, 3, 4, 8, requires_grad=True)
    branch = torch.randn(6, 3, 4, 8, requires_grad=True)
    alpha = nn.Parameter(torch.rand(8) + 0.1) if with_scale else None
    plain_module = DropPath(drop_prob).train(training)
    inputs = [x, branch] + ([alpha] if with_scale else [])
    torch.manual_seed(3)
    fused = blocks.weighted_residual(x, branch, alpha, plain_module)
    grads_fused = torch.autograd.grad(fused.square().sum(), inputs)
    torch.manual_seed(3)
    plain = x + plain_module(branch * alpha if with_scale else branch)
    grads_plain = torch.autograd.grad(plain.square().sum(), inputs)
    torch.testing.assert_close(fused, plain)
    for got, expected in zip(grads_fused, grads_plain, strict=True):
        torch.testing.assert_close(got, expected)
    if training and drop_prob > 0.0:  # with seed 3 some of the 6 samples are dropped and some kept
        dropped = (fused - x).flatten(1).abs().amax(1) == 0
        assert 0 < dropped.sum() < 6
        kept_sample = int((~dropped).nonzero()[0])
        expected_kept = branch[kept_sample] * (alpha if with_scale else 1.0) / (1.0 - drop_prob)
        torch.testing.assert_close(fused[kept_sample] - x[kept_sample], expected_kept)


def test_l2_normalize_equals_f_normalize_with_its_eps_floor():
    """SCSA's multiply-by-reciprocal-norm form is F.normalize (x / max(||x||, eps)): values and gradients, a zero row
    included, and fp16 rows whose squares overflow fp16."""
    import torch.nn.functional as F

    x = torch.randn(3, 4, 7, 16, dtype=torch.float64)
    x[0, 0, 0] = 0.0
    x[1, 0, 0] = 1e-13  # below eps: divided by eps, not by its norm
    x.requires_grad_(True)
    ours, reference = l2_normalize(x, 1e-12), F.normalize(x, dim=-1, eps=1e-12)
    torch.testing.assert_close(ours, reference, rtol=1e-12, atol=0)
    weights = torch.randn_like(x)
    torch.testing.assert_close(torch.autograd.grad((ours * weights).sum(), x)[0],
                               torch.autograd.grad((reference * weights).sum(), x)[0], rtol=1e-10, atol=1e-10)
    large = torch.full((2, 16), 300.0, dtype=torch.float16)  # 300^2 * 16 overflows fp16
    torch.testing.assert_close(l2_normalize(large, 1e-12), torch.full_like(large, 0.25))
