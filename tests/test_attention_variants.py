"""The attention kernels of the ablations against their papers: LipsFormer (Qi et al., ICLR 2023) section 4.1.2 and
Theorem 1; Kim et al., ICML 2021, Theorems 3.1-3.2, Appendix F and Figure 2; Dasoulas et al., ICML 2021, Corollary 2.

L2 attention (Kim et al. 2021), LipschitzNorm attention (Dasoulas et al. 2021), dot product and SCSA: definitions,
fused == explicit paths, closed-form Jacobians, and measured Jacobian norms under the theorems' bounds.
"""
import math

import pytest
import timm
import torch
from tiny_models import TINY_MODELS
from torch.autograd.functional import jacobian

from lipsformer.layers import (
    DotProductAttention,
    L2Attention,
    LipschitzNormAttention,
    ScaledCosineAttention,
    create_attention_kernel,
)
from lipsformer.lipschitz import jacobian_norm_ascent, kim_c, kim_mha_bound_2, kim_mha_bound_inf, scsa_head_bound
from lipsformer.lipschitz.theorems import DASOULAS_SELF_ATTENTION

pytestmark = pytest.mark.usefixtures('one_thread')


def _sigma(matrix: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(matrix, ord=2).item()


def _inf(matrix: torch.Tensor) -> float:
    return matrix.abs().sum(-1).max().item()


def _qkv(batch=2, heads=3, tokens=10, head_dim=8, scale=1.0):
    return [torch.randn(batch, heads, tokens, head_dim, dtype=torch.float64) * scale for _ in range(3)]


def _fused_and_explicit(kernel, *args):
    kernel.fused_attn = True
    fused = kernel(*args)
    kernel.fused_attn = False
    return fused, kernel(*args)


# --- L2 attention -------------------------------------------------------------------------------------------------

def test_l2_attention_matches_kims_definition_fused_and_explicit():
    kernel = L2Attention(head_dim=8, num_heads=3).double()
    torch.nn.init.normal_(kernel.value_map)
    x = torch.randn(2, 3, 10, 8, dtype=torch.float64)
    bias = torch.randn(1, 3, 10, 10, dtype=torch.float64)
    mask = torch.zeros(2, 1, 1, 10, dtype=torch.float64)
    mask[..., -3:] = float('-inf')  # padded keys, as CSwin's cut stripes
    for attn_bias in (None, bias, bias + mask):
        distances = (x.unsqueeze(-2) - x.unsqueeze(-3)).pow(2).sum(-1)  # direct, not the expansion
        logits = -distances / math.sqrt(8) + (0 if attn_bias is None else attn_bias)
        reference = logits.softmax(-1) @ (x @ kernel.value_map)
        for out in _fused_and_explicit(kernel, x, x, x, attn_bias):
            torch.testing.assert_close(out, reference, atol=1e-12, rtol=1e-10)


def test_l2_attention_is_accurate_far_from_the_origin():
    """Centring keeps the distance expansion exact when every token is shifted far away (float32)."""
    kernel = L2Attention(head_dim=16, num_heads=2)
    x = torch.randn(1, 2, 49, 16)
    near = kernel(x, x, x)
    shifted = x + 1e4
    far = kernel(shifted, shifted, shifted) - 1e4  # values are q @ M with M = I: they move with the shift
    torch.testing.assert_close(far, near, atol=2e-2, rtol=0)
    kernel.fused_attn = False
    torch.testing.assert_close(kernel(shifted, shifted, shifted) - 1e4, near, atol=2e-2, rtol=0)


def _kim_l2_mha(x, w_query, w_value, w_out):
    """Kim et al.'s L2-MHA (tied W^Q = W^K; head P X A_h W^V_h; concat; W^O) through our kernel."""
    num_heads, _, head_dim = w_query.shape
    kernel = L2Attention(head_dim, num_heads).double()
    with torch.no_grad():
        kernel.value_map.copy_(w_query.transpose(1, 2) @ w_value / math.sqrt(head_dim))  # M_h = W^Q^T W^V / sqrt(d)
    y = torch.einsum('nD,hDd->hnd', x, w_query).unsqueeze(0)
    return kernel(y, y, y)[0].transpose(0, 1).reshape(x.shape[0], -1) @ w_out


def test_l2_jacobian_matches_kims_closed_form():
    """Kim et al. Appendix F: J_ii = 2 A X^T P^(i) X A + P_ii A, J_ij = 2 P_ij A (x_j - sum_k P_ik x_k)(x_i - x_j)^T A +
    P_ij A for one head with A = W^Q W^Q^T / sqrt(D/H)."""
    tokens, dim = 6, 3
    w_query = torch.randn(1, dim, dim, dtype=torch.float64)
    x = torch.randn(tokens, dim, dtype=torch.float64)
    attention = lambda inputs: _kim_l2_mha(inputs, w_query, torch.eye(dim, dtype=torch.float64)[None],  # noqa: E731
                                           torch.eye(dim, dtype=torch.float64))
    autograd = jacobian(attention, x)  # [i, :, j, :] = d f_i / d x_j
    a = w_query[0] @ w_query[0].T / math.sqrt(dim)
    y = x @ w_query[0]
    p = (-(y.unsqueeze(1) - y.unsqueeze(0)).pow(2).sum(-1) / math.sqrt(dim)).softmax(-1)
    for i in range(tokens):
        p_i = torch.diag(p[i]) - torch.outer(p[i], p[i])
        expected = 2 * a @ x.T @ p_i @ x @ a + p[i, i] * a
        torch.testing.assert_close(autograd[i, :, i, :], expected)
        mean_i = p[i] @ x
        for j in range(tokens):
            if j != i:
                expected = 2 * p[i, j] * a @ torch.outer(x[j] - mean_i, x[i] - x[j]) @ a + p[i, j] * a
                torch.testing.assert_close(autograd[i, :, j, :], expected)


@pytest.mark.parametrize('seed', range(3))
def test_l2_mha_jacobian_is_below_kims_theorem_3_2(seed):
    """Kim et al. Theorem 3.2, N=8, D=4, H=2, standard normal weights and inputs (computed: about 89 <= 1319 in the
    inf-norm, 35 <= 353 in the 2-norm)."""
    torch.manual_seed(seed)
    tokens, dim, heads = 8, 4, 2
    head_dim = dim // heads
    w_query, w_value = (torch.randn(heads, dim, head_dim, dtype=torch.float64) for _ in range(2))
    w_out = torch.randn(dim, dim, dtype=torch.float64)
    bound_inf = kim_mha_bound_inf(tokens, head_dim, [_inf(w) for w in w_query], [_inf(w.T) for w in w_query],
                                  [_inf(w.T) for w in w_value], _inf(w_out.T))
    bound_2 = kim_mha_bound_2(tokens, head_dim, [_sigma(w) for w in w_query], [_sigma(w) for w in w_value],
                              _sigma(w_out))
    assert 300 < bound_inf < 5000 and 50 < bound_2 < 1000  # the paper's example's range
    for scale in (0.1, 1.0, 3.0):
        x = torch.randn(tokens, dim, dtype=torch.float64) * scale
        full = jacobian(lambda inputs: _kim_l2_mha(inputs, w_query, w_value, w_out), x).reshape(tokens * dim, -1)
        assert 0 < _inf(full) <= bound_inf
        assert 0 < _sigma(full) <= bound_2


def test_kim_figure_2_lower_bound_is_close_to_the_upper_bound():
    """Kim et al. Figure 2 (tightness), D = H = 1, all weights 1, N = 100; Adam on ||J(X)||_inf from random starts
    reaches about 88% of 4 W0(99/e) + 1 = 11.51 (must be within 80-100%).

    The map is permutation equivariant, so the largest row sum of J over inputs is that of row 0: the ascent
    maximises row 0 (one backward pass per step instead of a full Jacobian) and the full inf-norm is checked at
    the best point.
    """
    kernel = L2Attention(head_dim=1, num_heads=1).double()
    kernel.fused_attn = False  # the ascent differentiates a Jacobian: the fused CPU kernel has no double backward
    attention = lambda x: kernel(x.view(1, 1, -1, 1), x.view(1, 1, -1, 1), x.view(1, 1, -1, 1)).flatten()  # noqa
    upper = 4 * kim_c(100) + 1
    assert upper == pytest.approx(11.51, abs=5e-3)
    best, best_point = 0.0, None
    for seed in range(6):
        x = torch.randn(100, dtype=torch.float64, generator=torch.Generator().manual_seed(seed)).requires_grad_(True)
        optimizer = torch.optim.Adam([x], lr=0.1, maximize=True)
        for _ in range(300):
            (row,) = torch.autograd.grad(attention(x)[0], x, create_graph=True)
            row_sum = row.abs().sum()
            if row_sum.item() > best:
                best, best_point = row_sum.item(), x.detach().clone()
            optimizer.zero_grad()
            row_sum.backward()
            optimizer.step()
    full = jacobian(attention, best_point)
    assert 0.8 * upper <= _inf(full) <= upper
    assert _inf(full) >= best


# --- LipschitzNorm attention --------------------------------------------------------------------------------------

def test_lipschitz_norm_matches_dasoulas_definition_fused_and_explicit():
    kernel = LipschitzNormAttention().double()
    q, k, v = _qkv()
    bias = torch.randn(1, 3, 10, 10, dtype=torch.float64)
    u = q.pow(2).sum((-2, -1), keepdim=True).sqrt()
    key_max = k.norm(dim=-1).amax(-1)[..., None, None]
    value_max = v.norm(dim=-1).amax(-1)[..., None, None]
    denominator = torch.maximum(torch.maximum(u * key_max, u * value_max), key_max * value_max)
    reference = (q @ k.transpose(-1, -2) / denominator + bias).softmax(-1) @ v
    for out in _fused_and_explicit(kernel, q, k, v, bias):
        torch.testing.assert_close(out, reference)
    zeros = torch.zeros(1, 1, 4, 8)
    assert torch.isfinite(kernel.float()(zeros, zeros, zeros)).all()  # the floor keeps 0 / 0 away


def test_lipschitz_norm_is_below_10_55_where_dot_product_grows():
    """Dasoulas et al. Corollary 2: the Jacobian of (Q, K, V) -> Attn in Frobenius norms stays <= 10.55 (m = n), while
    the unnormalised Q K^T / sqrt(d) one grows with the input scale."""
    tokens, head_dim = 6, 4
    lipnorm, dot = LipschitzNormAttention().double(), DotProductAttention(head_dim).double()
    lipnorm.fused_attn = False  # the ascent differentiates a Jacobian: the fused CPU kernel has no double backward

    def as_function(kernel):
        def attention(flat):
            q, k, v = flat.view(3, 1, 1, tokens, head_dim)
            return kernel(q, k, v).flatten()
        return attention

    assert DASOULAS_SELF_ATTENTION == pytest.approx(10.55, abs=5e-3)
    dot_norms = []
    for scale in (0.01, 1.0, 3.0, 100.0):
        point = torch.randn(3 * tokens * head_dim, dtype=torch.float64) * scale
        assert _sigma(jacobian(as_function(lipnorm), point)) <= DASOULAS_SELF_ATTENTION
        if scale in (1.0, 3.0):
            dot_norms.append(_sigma(jacobian(as_function(dot), point)))
    assert dot_norms[1] > 3 * dot_norms[0]
    worst = jacobian_norm_ascent(as_function(lipnorm), torch.randn(3 * tokens * head_dim, dtype=torch.float64),
                                 ord=2, steps=40, lr=0.05)
    assert worst <= DASOULAS_SELF_ATTENTION


# --- dot product and SCSA -----------------------------------------------------------------------------------------

def _counterexample(scale: float, tokens: int = 5, dim: int = 4) -> torch.Tensor:
    """Kim et al. Thm 3.1: one token at 0, the others standard normal scaled by s."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(tokens, dim, generator=generator, dtype=torch.float64) * scale
    x[0] = 0
    return x


def test_dot_product_jacobian_grows_like_s_squared_while_scsa_stays_bounded():
    """Kim et al. Theorem 3.1 against LipsFormer Theorem 1: the dot-product Jacobian grows ~s^2 (about 2 -> 9e3 for
    s = 1 -> 100); SCSA's does not, and its output rows never exceed nu."""
    dim = 4
    dot = DotProductAttention(dim).double()
    scsa = ScaledCosineAttention(tau=12.0, v_norm=True, nu=0.8, eps=1e-2).double()

    def self_attention(kernel):
        return lambda x: kernel(x[None, None], x[None, None], x[None, None])[0, 0]

    dot_norms = {s: _sigma(jacobian(self_attention(dot), _counterexample(s)).reshape(20, 20)) for s in (1, 10, 100)}
    assert 1 < dot_norms[1] < 5 and dot_norms[100] > 1e3
    assert math.log10(dot_norms[100] / dot_norms[10]) == pytest.approx(2.0, abs=0.1)
    bound = scsa_head_bound(5, 12.0, 0.8, 1 / 1e-2, 1.0, 1.0, 1.0)  # W^Q = W^K = W^V = I
    scsa_norms = [_sigma(jacobian(self_attention(scsa), _counterexample(s)).reshape(20, 20)) for s in (1, 10, 100)]
    assert max(scsa_norms) <= 1.01 * min(scsa_norms) and max(scsa_norms) <= bound
    out = self_attention(scsa)(_counterexample(1e4))
    assert out.norm(dim=-1).max() <= 0.8 + 1e-12


def _scsa_head(kernel, w_query, w_key, w_value, bias=None):
    def head(x):
        q, k, v = (x @ w.T for w in (w_query, w_key, w_value))
        return kernel(q[None, None], k[None, None], v[None, None], bias)[0, 0]
    return head


def test_scsa_jacobian_at_zero_is_nu_sigma_v_over_eps():
    """LipsFormer Theorem 1 at X = 0 (computed): ||J(0)||_2 = nu sigma_max(W^V) / sqrt(eps) for the paper's
    q / sqrt(|q|^2 + eps); our normalisation (the authors', F.normalize: q / max(|q|, eps)) has the same value with
    sqrt(eps) -> eps."""
    eps, nu = 1e-3, 0.7
    kernel = ScaledCosineAttention(tau=12.0, v_norm=True, nu=nu, eps=eps).double()
    w_query, w_key, w_value = (torch.randn(4, 6, dtype=torch.float64) for _ in range(3))
    full = jacobian(_scsa_head(kernel, w_query, w_key, w_value), torch.zeros(5, 6, dtype=torch.float64))
    assert _sigma(full.reshape(20, 30)) == pytest.approx(nu * _sigma(w_value) / eps, rel=1e-9)


@pytest.mark.parametrize('scale', [1e-4, 1e-2, 1.0, 1e2])
def test_scsa_jacobian_is_below_the_theorem_1_bound(scale):
    """LipsFormer Theorem 1, with a relative-position-like bias: measured norms stay under the bound."""
    eps, tau, nu, tokens = 1e-2, 12.0, 1.0, 7
    kernel = ScaledCosineAttention(tau=tau, v_norm=True, nu=nu, eps=eps).double()
    w_query, w_key, w_value = (torch.randn(4, 6, dtype=torch.float64) for _ in range(3))
    bias = torch.randn(tokens, tokens, dtype=torch.float64)
    bound = scsa_head_bound(tokens, tau, nu, 1 / eps, _sigma(w_query), _sigma(w_key), _sigma(w_value))
    head = _scsa_head(kernel, w_query, w_key, w_value, bias)
    for _ in range(3):
        x = torch.randn(tokens, 6, dtype=torch.float64) * scale
        assert _sigma(jacobian(head, x).reshape(tokens * 4, tokens * 6)) <= bound


# --- in the models ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize('name', TINY_MODELS)
@pytest.mark.parametrize('attn_type', ['l2', 'lipnorm'])
def test_variants_run_in_both_families_on_the_fused_path(name, attn_type):
    model = timm.create_model(name, attn_type=attn_type, **TINY_MODELS[name]).eval()
    kernels = [m for m in model.modules() if hasattr(m, 'fused_attn')]
    assert kernels and all(m.fused_attn for m in kernels)
    x = torch.randn(2, 3, 64, 96)  # cut windows and stripes: padding, masks
    with torch.no_grad():
        fused = model(x)
        for kernel in kernels:
            kernel.fused_attn = False
        torch.testing.assert_close(model(x), fused, atol=1e-5, rtol=0)
    model.train()
    model(x).logsumexp(-1).mean().backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
    scripted = torch.jit.script(timm.create_model(name, attn_type=attn_type, **TINY_MODELS[name]).eval())
    assert torch.isfinite(scripted(x[:1])).all()


def test_l2_ties_queries_keys_and_values_to_one_projection():
    for name in TINY_MODELS:
        model = timm.create_model(name, attn_type='l2', **TINY_MODELS[name])
        attn = model.stages[2].blocks[0].attn
        assert attn.qkv.weight.shape == (64, 64)  # one projection, not three
        kernels = [m for m in attn.modules() if isinstance(m, L2Attention)]
        assert all(torch.equal(k.value_map, torch.eye(k.head_dim).expand_as(k.value_map)) for k in kernels)
        assert sum(k.num_heads for k in kernels) == TINY_MODELS[name]['num_heads'][2]
    with pytest.raises(ValueError, match='num_heads'):
        create_attention_kernel('l2', 8, tau=1.0)
    with pytest.raises(ValueError, match="'lipnorm'"):
        create_attention_kernel('l3', 8, tau=1.0)


def test_lepe_with_tied_projection_matches_manual_stripe_attention():
    """CSwin with L2: LePE convolves the tied projection inside each stripe, as it convolves v otherwise."""
    from lipsformer.models.lipsformer_cswin import StripeAttention
    branch = StripeAttention(8, 2, L2Attention(4, 2)).eval()
    torch.nn.init.normal_(branch.kernel.value_map)
    projection = torch.randn(1, 4, 3, 8)  # one 4x3 stripe
    y = projection.reshape(1, 12, 2, 4).transpose(1, 2)
    lepe = branch.lepe(projection.permute(0, 3, 1, 2)).reshape(1, 2, 4, 12).transpose(-1, -2)
    expected = (branch.kernel(y, y, y) + lepe) * 2 ** -0.5
    torch.testing.assert_close(branch(projection.unsqueeze(3), 4, 3), expected.transpose(1, 2).reshape(1, 4, 3, 8))


# --- the shared softmax-attention tail ----------------------------------------------------------------------------

def _reference_attention(q, k, v, bias, scale):
    return torch.softmax(scale * q @ k.transpose(-2, -1) + bias, dim=-1) @ v


@pytest.mark.parametrize('bias_needs_grad', [True, False])
@pytest.mark.parametrize('fused', [True, False])
def test_softmax_attention_equals_its_definition_in_values_and_gradients(bias_needs_grad, fused):
    """Every route of softmax_attention (SDPA, explicit with the in-place bias sum) is softmax(s q k^T + B) v."""
    from lipsformer.layers.softmax_attention import softmax_attention
    q, k, v = (tensor.requires_grad_() for tensor in _qkv())
    bias = torch.randn(3, 10, 10, dtype=torch.float64, requires_grad=bias_needs_grad)
    bias_before = bias.detach().clone()
    out = softmax_attention(q, k, v, bias, 0.0, fused, 0.7)
    expected = _reference_attention(q, k, v, bias, 0.7)
    torch.testing.assert_close(out, expected)
    inputs = [q, k, v] + ([bias] if bias_needs_grad else [])
    weights = torch.randn_like(out)
    for got, want in zip(torch.autograd.grad((out * weights).sum(), inputs),
                         torch.autograd.grad((expected * weights).sum(), inputs), strict=True):
        torch.testing.assert_close(got, want)
    assert torch.equal(bias.detach(), bias_before)  # the in-place sum writes into the logits, never the bias


def test_softmax_attention_leaves_sdpa_on_cpu_only_where_a_backward_runs(monkeypatch):
    """On CPU SDPA computes attention without a backward; with one (any of q, k, v or a learned bias needing a
    gradient, grad mode on) the explicit path does, which is also twice differentiable."""
    import lipsformer.layers.softmax_attention as module
    calls = []
    sdpa = module.F.scaled_dot_product_attention

    def recording_sdpa(*args, **kwargs):
        calls.append(1)
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(module.F, 'scaled_dot_product_attention', recording_sdpa)
    q, k, v = _qkv()
    learned = torch.zeros(3, 10, 10, dtype=torch.float64, requires_grad=True)
    module.softmax_attention(q, k, v, learned, 0.0, True)
    module.softmax_attention(q.requires_grad_(), k, v, None, 0.0, True)
    assert calls == []
    with torch.no_grad():
        module.softmax_attention(q, k, v, learned, 0.0, True)
    module.softmax_attention(q.detach(), k, v, learned.detach(), 0.0, True)
    module.softmax_attention(q.detach(), k, v, None, 0.0, True)
    assert len(calls) == 3
    module.softmax_attention(q.detach(), k, v, None, 0.0, False)
    assert len(calls) == 3


def test_softmax_attention_takes_a_float32_bias_under_bf16_autocast():
    """Under CPU bf16 autocast the logits are bf16 and a learned bias fp32: the explicit path adds them out of place
    (an in-place sum into bf16 would need the same dtype) and the bias still gets its gradient."""
    from lipsformer.layers.softmax_attention import softmax_attention
    q, k, v = (tensor.float() for tensor in _qkv())
    bias = torch.randn(3, 10, 10, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        out = softmax_attention(q, k, v, bias, 0.0, True)
    out.float().sum().backward()
    assert bias.grad is not None and torch.isfinite(bias.grad).all()
    torch.testing.assert_close(out.float(), _reference_attention(q, k, v, bias, 1.0), atol=3e-2, rtol=3e-2)
