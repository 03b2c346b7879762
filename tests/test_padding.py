"""Windows and stripes cut by the map border: their padded tokens add nothing to any output or gradient.

A Swin window or CSwin stripe that the map's border cuts is padded with zero q, k and v whose keys are masked. A
padded token must not reach a valid token's output (it attends over its valid tokens alone), nor a gradient (a zero
q or k, through the l2 normalisation, would otherwise bring a 1 / eps factor), and a zero row must normalise to zero
in float16, where the authors' eps of 1e-12 rounds to zero.
"""

import pytest
import timm
import torch
from forms_support import form, in_form
from padding_support import assert_no_gradient_at_the_padding, recording_padding, zero_lepe
from tiny_models import EXPORT_MODELS, TINY_CSWIN, TINY_SWIN

import lipsformer.fastpath.forms
from lipsformer.fastpath import l2_normalize, l2_normalize_op
from lipsformer.layers import ATTENTION_TYPES, ScaledCosineAttention, create_attention_kernel
from lipsformer.models.lipsformer_cswin import StripeAttention
from lipsformer.models.lipsformer_swin import WindowAttention

# The tiny shapes at a size whose windows (Swin: 4x4 windows over 16x24, 8x12 and 4x6 maps) or stripes (CSwin: stripes
# 3 wide over a 4x6 map in the third stage) need padding, and one where none does.
PADDED = (64, 96)
UNPADDED = (64, 64)
MODELS = {
    'swin': ('lipsformer_swin_tiny', TINY_SWIN),
    'cswin': ('lipsformer_cswin_tiny', dict(TINY_CSWIN, split_size=(1, 2, 3, 3))),
}


def _model(family: str, **kwargs) -> torch.nn.Module:
    name, shape = MODELS[family]
    torch.manual_seed(0)
    return timm.create_model(name, **dict(shape, drop_path_rate=0.0, **kwargs))


def _gradient_norm(model: torch.nn.Module, size: tuple[int, int]) -> float:
    torch.manual_seed(1)
    model.zero_grad(set_to_none=True)
    logits = model(torch.randn(2, 3, *size, dtype=next(model.parameters()).dtype))
    logits.float().logsumexp(-1).mean().backward()
    grads = [p.grad.float() for p in model.parameters() if p.grad is not None]
    assert all(torch.isfinite(g).all() for g in grads)
    return torch.nn.utils.get_total_norm(grads).item()


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('family', MODELS)
def test_padding_leaves_the_gradient_norm_at_its_unpadded_scale(family, fast):
    model = _model(family).train()
    with form(model, fast):
        unpadded, padded = _gradient_norm(model, UNPADDED), _gradient_norm(model, PADDED)
    assert unpadded / 3 < padded < unpadded * 3


@pytest.fixture
def fast_path_calls(monkeypatch) -> list[torch.dtype]:
    """The dtypes SCSA's fast normalisation was called with."""
    calls, normalize = [], lipsformer.fastpath.forms.l2_normalize

    def spy(x, *args, **kwargs):
        calls.append(x.dtype)
        return normalize(x, *args, **kwargs)

    monkeypatch.setattr(lipsformer.fastpath.forms, 'l2_normalize', spy)
    return calls


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16], ids=['fp16', 'bf16'])
@pytest.mark.parametrize('family', MODELS)
def test_padded_sizes_give_finite_half_precision_logits_and_gradients(family, dtype, fast, fast_path_calls):
    model = _model(family).to(dtype).train()
    with form(model, fast):
        with torch.no_grad():
            logits = model.eval()(torch.randn(2, 3, *PADDED, dtype=dtype))
        assert torch.isfinite(logits).all()
        _gradient_norm(model.train(), PADDED)  # asserts the gradients finite
    assert bool(fast_path_calls) == fast and all(d == dtype for d in fast_path_calls)


# The real windows (7) and stripes (1, 2, 7, 7) at narrow widths, at padded sizes: windows and stripes cut in every
# stage (256x320), a model built for 96 (windows 7, 7, 6, 3: the 24x24 and 12x12 stages pad), and a 64x64 input into
# a 224 model (every stage padded, the last 2x2 map inside one 7x7 window).
SIZES = {'256x320': (224, (256, 320)), '96': (96, (96, 96)), '64': (224, (64, 64))}


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('size', SIZES)
@pytest.mark.parametrize('name', ['lipsformer_swin_tiny', 'lipsformer_cswin_tiny'])
def test_half_precision_logits_are_finite_at_every_size(name, size, fast):
    img_size, input_size = SIZES[size]
    torch.manual_seed(0)
    model = timm.create_model(name, img_size=img_size, **EXPORT_MODELS[name]).eval()
    x = torch.randn(1, 3, *input_size)
    with form(model, fast), torch.no_grad():
        reference = model(x)
        for dtype in (torch.float16, torch.bfloat16):
            logits = model.to(dtype)(x.to(dtype)).float()
            assert torch.isfinite(logits).all(), dtype
            # Not just finite: the float32 logits to half precision's rounding through the blocks.
            torch.testing.assert_close(logits, reference, rtol=0, atol=0.1 * reference.abs().max().item())
        model.float()
        with torch.autocast('cpu', dtype=torch.bfloat16):
            assert torch.isfinite(model(x)).all()


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('dtype', [torch.float32, torch.float16], ids=['fp32', 'fp16'])
@pytest.mark.parametrize('family', MODELS)
def test_no_gradient_reaches_the_padded_tokens(family, dtype, fast):
    """The gradient at every padded q, k and v is exactly zero: padded keys take no attention weight from any query,
    and a padded query's output is cut off. (CSwin's LePE, zeroed here, is tested against a narrower stripe below.)"""
    model = _model(family).to(dtype).train()
    zero_lepe(model)
    with form(model, fast), recording_padding() as padded_tensors:
        model(torch.randn(2, 3, *PADDED, dtype=dtype)).float().logsumexp(-1).mean().backward()
    assert_no_gradient_at_the_padding(padded_tensors)


def _reference_window_attention(attn: WindowAttention, x: torch.Tensor) -> torch.Tensor:
    """``attn.attend(x)`` computed window by window over each window's valid tokens alone (without padding), with
    the relative-position bias of those tokens and, in shifted windows, -inf between the regions the roll joined."""
    height, width = x.shape[1], x.shape[2]
    window_h, window_w = attn.window_size
    shift_h, shift_w = attn.shift_size
    x = torch.roll(x, shifts=(-shift_h, -shift_w), dims=(1, 2))
    rows, columns = torch.meshgrid(torch.arange(height), torch.arange(width), indexing='ij')
    region = 2 * (rows >= height - shift_h).long() + (columns >= width - shift_w).long()
    bias = attn.relative_position_bias()
    out = torch.zeros(x.shape[0], height, width, x.shape[3], dtype=x.dtype)
    for top in range(0, height, window_h):
        for left in range(0, width, window_w):
            window_rows, window_columns = rows[top:top + window_h, left:left + window_w].flatten(), columns[
                top:top + window_h, left:left + window_w].flatten()
            index = (window_rows - top) * window_w + window_columns - left  # position in the whole window
            tokens = x[:, window_rows, window_columns]
            qkv = attn.qkv(tokens).unflatten(-1, (-1, attn.num_heads, tokens.shape[-1] // attn.num_heads))
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0) if not attn.tied_qkv else [qkv[:, :, 0].transpose(1, 2)] * 3
            token_region = region[window_rows, window_columns]
            apart = token_region[:, None] != token_region[None, :]
            window_bias = bias[:, index][:, :, index].masked_fill(apart, float('-inf'))
            out[:, window_rows, window_columns] = attn.kernel(q, k, v, window_bias).transpose(1, 2).flatten(2)
    return torch.roll(out, shifts=(shift_h, shift_w), dims=(1, 2))


@pytest.mark.parametrize(('size', 'shift'), [((8, 8), (0, 0)), ((6, 7), (0, 0)), ((8, 8), (2, 2)), ((5, 7), (2, 2)),
                                             ((6, 5), (2, 1))])
@pytest.mark.parametrize('attn_type', ATTENTION_TYPES)
def test_a_window_cut_by_the_border_attends_over_its_valid_tokens_alone(attn_type, size, shift):
    """Swin's attention in value and gradient (input, projections, relative-position table, kernel) equals attention
    over each window's valid tokens alone, unshifted and shifted, at sizes with and without padding."""
    torch.manual_seed(0)
    dim, heads = 8, 2
    kernel = create_attention_kernel(attn_type, dim // heads, tau=10.0, num_heads=heads)
    attn = WindowAttention(dim, heads, (4, 4), shift, kernel).double()
    with torch.no_grad():
        attn.qkv.bias.normal_()  # padded tokens would take the projection's bias, were they padded before it
        attn.relative_position_bias_table.normal_()
    x = torch.randn(2, *size, dim, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, *size, dim, dtype=torch.float64)
    results = []
    for attend in (attn.attend, lambda x: _reference_window_attention(attn, x)):
        attn.zero_grad(set_to_none=True)
        x.grad = None
        out = attend(x)
        (out * weights).sum().backward()
        results.append((out.detach(), x.grad, {n: p.grad for n, p in attn.named_parameters() if p.grad is not None}))
    (out, grad_x, grads), (expected, expected_grad_x, expected_grads) = results
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad_x, expected_grad_x)
    assert grads.keys() == expected_grads.keys()
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=lambda message, name=name: f'{name}: {message}')


@pytest.mark.parametrize('fast', [False, True], ids=['plain', 'fast'])
@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float32], ids=['fp16', 'bf16', 'fp32'])
def test_scsa_with_a_zero_query_and_a_masked_zero_key_is_finite_and_gives_them_no_gradient(dtype, fast):
    """A padded token as SCSA sees it: zero q, k and v, its key masked, its output cut off."""
    torch.manual_seed(0)
    q, k, v = torch.randn(3, 1, 2, 5, 8, dtype=dtype).unbind(0)
    for t in (q, k, v):
        t[..., 4, :] = 0.0
        t.requires_grad_()
    mask = torch.zeros(1, 1, 1, 5, dtype=dtype)
    mask[..., 4] = float('-inf')
    kernel = in_form(ScaledCosineAttention(tau=10.0, v_norm=True), fast)
    out = kernel(q, k, v, mask)
    assert torch.isfinite(out).all()
    reference = ScaledCosineAttention(tau=10.0, v_norm=True)(*(t.detach()[..., :4, :].double() for t in (q, k, v)))
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out[..., :4, :].double(), reference, rtol=0, atol=tolerance)
    grad = torch.randn_like(out)
    grad[..., 4, :] = 0.0
    out.backward(grad)
    for t in (q, k, v):
        assert torch.isfinite(t.grad).all() and not t.grad[..., 4, :].any()


@pytest.mark.parametrize('dtype', [torch.float16, torch.bfloat16, torch.float32], ids=['fp16', 'bf16', 'fp32'])
@pytest.mark.parametrize('normalize', [l2_normalize, l2_normalize_op.l2_normalize_op],
                         ids=['l2_normalize', 'custom_op'])
def test_fast_normalisation_of_a_zero_row_is_zero_where_scale_over_eps_overflows(normalize, dtype):
    """s / eps = 10 * 2**14 is past float16's largest number: the product must not be rounded before x multiplies it."""
    x = torch.randn(3, 4, 16, dtype=dtype)
    x[:, 1] = 0.0
    x.requires_grad_()
    with torch.no_grad():  # l2_normalize without a backward: the plain expression
        assert torch.equal(normalize(x, 2.0 ** -14, 10.0)[:, 1], torch.zeros_like(x[:, 1]))
    y = normalize(x, 2.0 ** -14, 10.0)
    assert torch.isfinite(y).all() and not y[:, 1].any()
    torch.testing.assert_close(y[:, 0].float().norm(dim=-1), torch.full((3,), 10.0), rtol=1e-2, atol=0)
    grad = torch.randn_like(y)
    grad[:, 1] = 0.0
    y.backward(grad)
    assert torch.isfinite(x.grad).all() and not x.grad[:, 1].any()


def test_shift_mask_without_padding_is_swins():
    """Where no padding is needed the two regions a dimension give Swin's three-region mask."""
    attn = WindowAttention(8, 2, (4, 4), (2, 2), create_attention_kernel('scsa', 4, tau=10.0))
    height, width = 12, 8
    region = torch.zeros(1, height, width, 1)
    count = 0
    for rows in (slice(0, -4), slice(-4, -2), slice(-2, None)):
        for columns in (slice(0, -4), slice(-4, -2), slice(-2, None)):
            region[:, rows, columns] = count
            count += 1
    region = region.view(1, 3, 4, 2, 4).permute(0, 1, 3, 2, 4).reshape(6, 16)
    swin = region.unsqueeze(1) - region.unsqueeze(2)
    swin = swin.masked_fill(swin != 0, -100.0).unsqueeze(1)
    torch.testing.assert_close(attn.shift_mask(height, width, torch.device('cpu')), swin)


@pytest.mark.parametrize('vertical', [True, False], ids=['vertical', 'horizontal'])
@pytest.mark.parametrize('attn_type', ATTENTION_TYPES)
def test_a_stripe_cut_by_the_border_is_a_narrower_stripe(attn_type, vertical):
    """CSwin's branch over a map its stripes do not divide equals, in value and gradient (q, k, v, LePE, kernel), the
    branch over each stripe alone, the last one as narrow as the map leaves it: padded keys are masked, and LePE reads
    the padded zeros as the zero padding at a narrower stripe's edge."""
    torch.manual_seed(0)
    dim, heads, width = 8, 2, 3
    kernel = create_attention_kernel(attn_type, dim // heads, tau=12.0, tau_learnable=True, num_heads=heads)
    branch = StripeAttention(dim, heads, kernel).double()
    projections = 1 if branch.tied_qkv else 3
    size = (5, 8) if vertical else (8, 5)  # stripes 3 wide: two whole ones and one of 2
    qkv = torch.randn(2, *size, projections, dim, dtype=torch.float64, requires_grad=True)
    weights = torch.randn(2, *size, dim, dtype=torch.float64)
    dimension = 2 if vertical else 1

    def stripe_by_stripe(qkv: torch.Tensor) -> torch.Tensor:
        stripes = qkv.split(width, dim=dimension)
        return torch.cat([branch(s, *((s.shape[1], s.shape[2]))) for s in stripes], dim=dimension)

    results = []
    for attend in (lambda qkv: branch(qkv, *((size[0], width) if vertical else (width, size[1]))), stripe_by_stripe):
        branch.zero_grad(set_to_none=True)
        qkv.grad = None
        out = attend(qkv)
        (out * weights).sum().backward()
        results.append((out.detach(), qkv.grad, {n: p.grad for n, p in branch.named_parameters()}))
    (out, grad_qkv, grads), (expected, expected_grad_qkv, expected_grads) = results
    torch.testing.assert_close(out, expected)
    torch.testing.assert_close(grad_qkv, expected_grad_qkv)
    assert grads.keys() == expected_grads.keys() and all(g is not None for g in grads.values())
    for name, grad in grads.items():
        torch.testing.assert_close(grad, expected_grads[name], msg=lambda message, name=name: f'{name}: {message}')
