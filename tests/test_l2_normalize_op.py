"""The ``lipsformer::l2_normalize`` custom op: SCSA's normalisation as one Triton kernel a direction.

Its Triton kernels run here on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, which must be set
before Triton is imported: those checks run in a subprocess); its PyTorch form, its fake-tensor registration and its
autograd formula are checked in this process.
"""
import textwrap

import pytest
import torch
import torch.nn.functional as F
from process_support import assert_runs_under_triton_interpreter

from lipsformer.fastpath import l2_normalize_op


def _reference(x: torch.Tensor, eps: float, scale: float) -> torch.Tensor:
    return F.normalize(x, dim=-1, eps=eps) * scale


@pytest.mark.parametrize('scale', [1.0, 12.0])
def test_the_pytorch_form_is_f_normalize_to_first_and_second_order(scale):
    x = torch.randn(2, 3, 5, 8, dtype=torch.float64, requires_grad=True)
    torch.testing.assert_close(l2_normalize_op.l2_normalize_op(x, 1e-12, scale), _reference(x, 1e-12, scale))
    assert torch.autograd.gradcheck(lambda t: l2_normalize_op.l2_normalize_op(t, 1e-12, scale), (x,))
    assert torch.autograd.gradgradcheck(lambda t: l2_normalize_op.l2_normalize_op(t, 1e-12, scale), (x,))


_LAYOUTS = {  # q (windows, heads, tokens, head_dim) from a (windows, tokens, q/k/v, heads, head_dim) projection
    'contiguous': lambda qkv: qkv[:, :, 0].transpose(1, 2).contiguous(),
    'heads of a projection': lambda qkv: qkv[:, :, 0].contiguous().transpose(1, 2),
    'a slice of a projection': lambda qkv: qkv[:, :, 0].transpose(1, 2),
}


@pytest.mark.parametrize('layout', _LAYOUTS)
def test_on_a_gpu_the_output_is_laid_out_as_the_input_s_strides(layout):
    """On a GPU a head's view of a projection normalises into memory laid out as the projection's (tokens before
    heads), so that fused attention writes its output in that layout and merging the heads back is a view (meta
    tensors, as on any device but the CPU: the op's fake registration)."""
    x = _LAYOUTS[layout](torch.empty(2, 7, 3, 4, 8, device='meta'))
    y = l2_normalize_op.l2_normalize_op(x, 1e-12, 3.0)
    order = sorted(range(3), key=lambda dim: -x.stride(dim))
    assert y.shape == x.shape and y.permute(*order, 3).is_contiguous()
    assert y.is_contiguous() == (layout == 'contiguous')


@pytest.mark.parametrize('layout', _LAYOUTS)
def test_on_the_cpu_the_output_is_contiguous_for_the_explicit_attention_product(layout):
    """On the CPU the op serves training, whose attention is a batched product reading each head contiguous; values
    and gradients are F.normalize's whatever the layout."""
    x = _LAYOUTS[layout](torch.randn(2, 7, 3, 4, 8, dtype=torch.float64)).requires_grad_()
    y = l2_normalize_op.l2_normalize_op(x, 1e-12, 3.0)
    assert y.is_contiguous()
    torch.testing.assert_close(y, _reference(x, 1e-12, 3.0))
    grad = torch.randn_like(y)
    (ours,) = torch.autograd.grad(y, x, grad)
    (expected,) = torch.autograd.grad(_reference(x, 1e-12, 3.0), x, grad)
    torch.testing.assert_close(ours, expected)


def test_a_row_below_eps_is_divided_by_eps_as_f_normalize_does():
    x = torch.zeros(3, 8, dtype=torch.float64)
    x[1] = 1.0
    x[2] = 1e-5
    x.requires_grad_()
    ours = x.detach().clone().requires_grad_()
    grad = torch.randn(3, 8, dtype=torch.float64)
    torch.autograd.backward(l2_normalize_op.l2_normalize_op(ours, 1e-3, 2.0), grad)
    torch.autograd.backward(_reference(x, 1e-3, 2.0), grad)
    torch.testing.assert_close(ours.grad, x.grad)


def test_l2_normalize_passes_gradcheck_also_where_the_norm_is_clamped():
    x = torch.randn(3, 4, 6, 5, dtype=torch.float64)
    x[0, 0, :2] *= 1e-3  # norms below eps: the clamped, linear branch
    x.requires_grad_(True)
    for scale in (10.0, 1.0):
        # Both outputs (the normalised x and the clamped squared norm), and twice: the backward is written in the
        # saved outputs, which autograd differentiates through the op again.
        assert torch.autograd.gradcheck(lambda t: torch.ops.lipsformer.l2_normalize(t, 1e-2, scale), (x,))
        assert torch.autograd.gradgradcheck(lambda t: torch.ops.lipsformer.l2_normalize(t, 1e-2, scale), (x,))
        assert torch.autograd.gradgradcheck(lambda t: torch.ops.lipsformer.l2_normalize(t, 1e-2, scale)[0], (x,))


def test_the_op_checks_out_under_torch_library_opcheck():
    """Fake-tensor registration, autograd registration and schema agree with the implementation."""
    x = torch.randn(4, 2, 6, 8, requires_grad=True)
    torch.library.opcheck(torch.ops.lipsformer.l2_normalize.default, (x, 1e-12, 12.0))


def test_compile_and_export_see_one_op():
    x = torch.randn(2, 4, 8)

    def normalise(t):
        return l2_normalize_op.l2_normalize_op(t, 1e-12, 3.0)

    exported = torch.export.export(_Normalise(), (x,))
    targets = [node.target for node in exported.graph.nodes if node.op == 'call_function']
    assert torch.ops.lipsformer.l2_normalize.default in targets
    torch.testing.assert_close(torch.compile(normalise, fullgraph=True, backend='eager')(x), _reference(x, 1e-12, 3.0))


class _Normalise(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return l2_normalize_op.l2_normalize_op(x, 1e-12, 3.0)


_TRITON_CHECKS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from lipsformer.fastpath import l2_normalize_op

    torch.manual_seed(0)
    def check(x, eps, scale, atol):
        assert l2_normalize_op.l2_normalize_kernels_run_on(x), 'the Triton kernels should run under the interpreter'
        ours = x.detach().clone().requires_grad_()
        reference = x.detach().float().clone().requires_grad_()
        y, squared_norm = torch.ops.lipsformer.l2_normalize(ours, eps, scale)
        expected = F.normalize(reference, dim=-1, eps=eps) * scale
        assert y.is_contiguous() and y.dtype == x.dtype and squared_norm.dtype == torch.float32
        torch.testing.assert_close(y.float(), expected, atol=atol, rtol=atol)
        torch.testing.assert_close(squared_norm, reference.detach().square().sum(-1, keepdim=True).clamp_min(eps * eps))
        grad = torch.randn_like(expected)
        torch.autograd.backward(y, grad.to(y.dtype))
        torch.autograd.backward(expected, grad)
        torch.testing.assert_close(ours.grad.float(), reference.grad, atol=atol * 10, rtol=atol * 10)

    qkv = torch.randn(4, 10, 3, 2, 8)                  # (windows, tokens, q/k/v, heads, head_dim)
    check(qkv.permute(2, 0, 3, 1, 4)[0], 1e-12, 12.0, 1e-5)   # a head's strided view of the projection
    check(torch.randn(6, 32), 1e-12, 1.0, 1e-5)        # contiguous rows
    window_qkv = torch.randn(7, 49, 3, 3, 32)          # 1029 rows of a Swin head: several programs, the last partial
    check(window_qkv.permute(2, 0, 3, 1, 4)[1], 1e-12, 12.0, 1e-5)
    check(torch.randn(2, 3, 4, 5, 6, 24).permute(0, 2, 1, 3, 4, 5), 1e-12, 10.0, 1e-5)  # five leading dims
    check(torch.randn(5, 7, 20), 1e-12, 1.0, 1e-5)     # a width that is not a power of two
    small = torch.randn(4, 16)
    small[1] = 1e-9                                    # a row below eps: divided by eps, gradient s g / eps
    check(small, 1e-6, 2.0, 1e-5)
    check(torch.randn(3, 8, 32).bfloat16(), 1e-12, 12.0, 2e-2)
    print('triton ok')
''')


def test_the_triton_kernels_under_the_interpreter():
    pytest.importorskip('triton')
    assert_runs_under_triton_interpreter(_TRITON_CHECKS, timeout_s=600)


def test_a_first_order_backward_is_the_one_backward_op():
    """Only y's gradient arrives (r^2's is None, not materialised zeros), so the backward is one op, not the
    differentiable expression's dozen."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    x = torch.randn(4, 8, requires_grad=True)
    y = l2_normalize_op.l2_normalize_op(x, 1e-12, 2.0)
    grad = torch.randn_like(y)
    with Recorder() as recorder:
        y.backward(grad)
    assert recorder.ops.count('lipsformer::l2_normalize_backward') == 1
    assert not any(name.startswith('aten::rsqrt') for name in recorder.ops)
    torch.testing.assert_close(x.grad, torch.autograd.grad(_reference(x, 1e-12, 2.0), x, grad)[0])
