"""CSwin's stripes as the GPU takes them, against the authors' per-stripe form in float64.

The authors (IDEA-Research/LipsFormer, commit 00acb80, models/cswin.py; CSWin's LePE) attend branch by branch: each
branch cuts its half of q, k and v into stripes and convolves v with LePE's 3x3 kernel stripe by stripe, zero-padded
at each stripe's edges. The model runs both branches of a square map as one attention call (the vertical stripes
transposed into rows) and LePE as one convolution over the map with zero lines between the stripes: the same values
and gradients, at square, non-square and padded sizes. So does its fast form, which on a square map convolves both
branches' halves of v at once.
"""
import math

import pytest
import torch
import torch.nn.functional as F
from forms_support import in_form
from torch.utils._python_dispatch import TorchDispatchMode

from lipsformer.layers import DotProductAttention, ScaledCosineAttention
from lipsformer.models.lipsformer_cswin import CrossStripeAttention


def _mixer(two_branches=True, split=2, attn_type='scsa', tau_learnable=False):
    def make_kernel(head_dim, heads):
        if attn_type == 'dot':
            return DotProductAttention(head_dim)
        return ScaledCosineAttention(tau=12.0, tau_learnable=tau_learnable)
    torch.manual_seed(0)
    mixer = CrossStripeAttention(8, 4, split, two_branches, make_kernel).double()
    for branch in mixer.branches:  # LePE's default init is small: make its share of the output count
        torch.nn.init.normal_(branch.lepe.weight)
        torch.nn.init.normal_(branch.lepe.bias)
    return mixer


def _authors_branch(branch, q, k, v, stripe_h, stripe_w):
    """One branch as the authors compute it: (B, H, W, C) q, k, v; stripes zero-padded at the map's border (their
    keys masked), LePE per stripe, (attention + LePE) / sqrt(heads)."""
    batch, height, width, channels = q.shape
    heads = branch.num_heads
    pad_h, pad_w = (-height) % stripe_h, (-width) % stripe_w
    q, k, v = (F.pad(t, (0, 0, 0, pad_w, 0, pad_h)) for t in (q, k, v))
    rows, cols = (height + pad_h) // stripe_h, (width + pad_w) // stripe_w

    def stripes(t):  # (B * stripes, stripe_h, stripe_w, C)
        t = t.reshape(batch, rows, stripe_h, cols, stripe_w, channels).permute(0, 1, 3, 2, 4, 5)
        return t.reshape(-1, stripe_h, stripe_w, channels)

    def heads_of(t):  # (B * stripes, heads, tokens, C / heads)
        return t.reshape(t.shape[0], -1, heads, channels // heads).transpose(1, 2)

    v_stripes = stripes(v)
    lepe = F.conv2d(v_stripes.permute(0, 3, 1, 2), branch.lepe.weight, branch.lepe.bias, padding=1, groups=channels)
    lepe = heads_of(lepe.permute(0, 2, 3, 1))
    valid = torch.zeros(1, height + pad_h, width + pad_w, 1, dtype=q.dtype)
    valid[:, :height, :width] = 1
    mask = torch.zeros_like(valid).masked_fill(valid == 0, float('-inf'))
    mask = stripes(mask.expand(batch, -1, -1, channels))[..., 0].reshape(-1, 1, 1, stripe_h * stripe_w)
    out = (branch.kernel(heads_of(stripes(q)), heads_of(stripes(k)), heads_of(v_stripes), mask) + lepe)
    out = (out * heads ** -0.5).transpose(1, 2).reshape(batch, rows, cols, stripe_h, stripe_w, channels)
    out = out.permute(0, 1, 3, 2, 4, 5).reshape(batch, rows * stripe_h, cols * stripe_w, channels)
    return out[:, :height, :width]


def _authors_attend(mixer, x):
    height, width = x.shape[1], x.shape[2]
    branches = len(mixer.branches)
    q, k, v = mixer.qkv(x).unflatten(-1, (3, branches, -1)).unbind(3)
    if branches == 1:
        return _authors_branch(mixer.branches[0], q[..., 0, :], k[..., 0, :], v[..., 0, :], height, width)
    split = mixer.split_size
    return torch.cat([
        _authors_branch(mixer.branches[0], q[..., 0, :], k[..., 0, :], v[..., 0, :], height, split),
        _authors_branch(mixer.branches[1], q[..., 1, :], k[..., 1, :], v[..., 1, :], split, width),
    ], dim=-1)


def _values_and_gradients(mixer, attend, x):
    x = x.clone().requires_grad_()
    out = attend(x)
    weights = torch.randn(out.shape, dtype=out.dtype, generator=torch.Generator().manual_seed(1))
    params = [p for name, p in mixer.named_parameters() if not name.startswith('proj.')]  # attend stops before proj
    grads = torch.autograd.grad((out * weights).sum(), [x, *params])
    return out, grads


@pytest.mark.parametrize('fast', [False, True])
@pytest.mark.parametrize('size', [(6, 6), (5, 5), (6, 4), (5, 7), (4, 6)])
@pytest.mark.parametrize('variant', ['scsa', 'dot', 'learned_tau', 'one_branch', 'split_1'])
def test_attention_and_lepe_equal_the_authors_per_stripe_form(variant, size, fast):
    mixer = _mixer(two_branches=variant != 'one_branch', split=1 if variant == 'split_1' else 2,
                   attn_type='dot' if variant == 'dot' else 'scsa', tau_learnable=variant == 'learned_tau')
    in_form(mixer, fast, 'cpu')
    x = torch.randn(2, *size, 8, dtype=torch.float64)
    ours, our_grads = _values_and_gradients(mixer, mixer.attend, x)
    theirs, their_grads = _values_and_gradients(mixer, lambda t: _authors_attend(mixer, t), x)
    torch.testing.assert_close(ours, theirs)
    for mine, reference in zip(our_grads, their_grads):
        torch.testing.assert_close(mine, reference)


def _calls(module):
    calls = []
    module.register_forward_hook(lambda *args: calls.append(1))
    return calls


@pytest.mark.parametrize('size, one_call', [((6, 6), True), ((5, 5), True), ((6, 4), False)])
def test_a_square_map_takes_one_attention_call_and_every_layer_is_called_as_its_module(size, one_call):
    """On a square map the first branch's kernel runs both halves' heads in one call; elsewhere each branch calls its
    own. Either way qkv, proj and both LePE convolutions are called as modules, so their hooks fire."""
    mixer = _mixer()
    assert mixer.one_call
    kernels = [_calls(branch.kernel) for branch in mixer.branches]
    layers = [_calls(module) for module in (mixer.qkv, mixer.proj, mixer.branches[0].lepe, mixer.branches[1].lepe)]
    mixer(torch.randn(2, *size, 8, dtype=torch.float64))
    assert [len(calls) for calls in kernels] == ([1, 0] if one_call else [1, 1])
    assert [len(calls) for calls in layers] == [1, 1, 1, 1]


def test_kernels_with_parameters_of_their_own_keep_a_call_each():
    """A learned tau (one per branch) is not one function of both halves' heads: each branch keeps its call."""
    mixer = _mixer(tau_learnable=True)
    assert not mixer.one_call
    kernels = [_calls(branch.kernel) for branch in mixer.branches]
    mixer(torch.randn(1, 4, 4, 8, dtype=torch.float64))
    assert [len(calls) for calls in kernels] == [1, 1]


class _Convolutions(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.count = 0
        self.shapes = []  # (input, weight) of each

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == 'aten::convolution':
            self.count += 1
            self.shapes.append((tuple(args[0].shape), tuple(args[1].shape)))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('size, convolutions', [((6, 6), 1), ((5, 5), 1), ((6, 4), 2)])
def test_the_fast_form_convolves_both_halves_of_v_at_once_on_a_square_map(size, convolutions):
    """Both branches' LePE kernels side by side, the vertical one transposed as its half of v is: one convolution a
    square map (padded or not), one a branch elsewhere, the plain form's values either way."""
    mixer = _mixer()
    x = torch.randn(2, *size, 8, dtype=torch.float64)
    plain = mixer.attend(x)
    in_form(mixer, True, 'cpu')
    with _Convolutions() as counted:
        fast = mixer.attend(x)
    assert counted.count == convolutions
    torch.testing.assert_close(fast, plain)


class _Pads(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes = []  # the input of each pad

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.name() == 'aten::constant_pad_nd':
            self.shapes.append(tuple(args[0].shape))
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize('fast', [False, True])
def test_a_padded_square_map_pads_q_k_and_v_with_one_copy(fast):
    """5x5 in stripes of 2: q, k and v of both halves, stacked, are padded by one copy (LePE's zero lines and the
    fast form's merged convolution may pad v again), none on a map the stripes divide."""
    mixer = in_form(_mixer(), fast, 'cpu')
    with _Pads() as padded:
        mixer.attend(torch.randn(2, 5, 5, 8, dtype=torch.float64))
    assert padded.shapes.count((3, 2, 5, 5, 8)) == 1
    assert not any(shape[:1] == (2,) and shape[-1] in (4, 8) and shape[1:3] == (5, 5) for shape in padded.shapes)
    with _Pads() as padded:
        mixer.attend(torch.randn(2, 6, 6, 8, dtype=torch.float64))
    assert (3, 2, 6, 6, 8) not in padded.shapes


@pytest.mark.parametrize('size', [6, 5])
def test_one_token_stripes_are_convolved_by_the_kernels_middle_rows_without_zero_lines(size):
    """Stripes one token wide (CSwin-T's first stage): beside each row only zeros, so the fast form convolves v itself
    by a 1x3 kernel (the vertical half's middle column, transposed as its map is), half the map the zero lines would
    make, and gives the plain form's values and gradients."""
    mixer = _mixer(split=1)
    x = torch.randn(2, size, size, 8, dtype=torch.float64)
    plain, plain_grads = _values_and_gradients(mixer, mixer.attend, x)
    in_form(mixer, True, 'cpu')
    with _Convolutions() as counted:
        fast, fast_grads = _values_and_gradients(mixer, mixer.attend, x)
    assert counted.shapes[0] == ((2, 8, size, size), (8, 1, 1, 3))
    torch.testing.assert_close(fast, plain)
    for mine, reference in zip(fast_grads, plain_grads):
        torch.testing.assert_close(mine, reference)


@pytest.mark.parametrize('fast', [False, True])
def test_a_wrapped_lepe_is_used_on_the_whole_map(fast):
    """A LePE wrapped by a tool (here a forward hook that doubles its output) changes the result as it would change
    the authors' per-stripe form: the module's own output is what is added, in the fast form too."""
    mixer = in_form(_mixer(), fast, 'cpu')
    x = torch.randn(1, 6, 6, 8, dtype=torch.float64)
    for branch in mixer.branches:
        branch.lepe.register_forward_hook(lambda module, args, out: out * 2)
    doubled = mixer.attend(x)
    for branch in mixer.branches:
        branch.lepe._forward_hooks.clear()
        with torch.no_grad():
            branch.lepe.weight.mul_(2)
            branch.lepe.bias.mul_(2)
    torch.testing.assert_close(doubled, mixer.attend(x))
    assert math.isfinite(doubled.sum().item())
