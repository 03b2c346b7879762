"""The ``lipsformer::depthwise_conv2d`` custom op: NHWC depthwise convolution whose CPU weight gradient runs through
oneDNN's forward kernel (tests/test_fastpath_cpu.py checks that gradient); here its values against ``F.conv2d``, its
fake-tensor registrations, autograd formula, compilation and export, and where the conv shortcuts' fast form takes it.
"""
import pytest
import torch
import torch.nn.functional as F
from forms_support import form

from lipsformer.fastpath import depthwise_conv_op
from lipsformer.fastpath.depthwise_conv_op import depthwise_conv2d_op


def _is_the_op(target) -> bool:
    """A graph node's target is the forward op (dynamo records the packet, export the overload)."""
    return target in (torch.ops.lipsformer.depthwise_conv2d, torch.ops.lipsformer.depthwise_conv2d.default)


def _reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return F.conv2d(x.permute(0, 3, 1, 2), weight, bias, padding=weight.shape[-1] // 2,
                    groups=x.shape[-1]).permute(0, 2, 3, 1)


@pytest.mark.parametrize('kernel_size', depthwise_conv_op.KERNEL_SIZES)
@pytest.mark.parametrize('with_bias', [True, False])
def test_the_pytorch_form_is_f_conv2d_to_first_and_second_order(kernel_size, with_bias):
    x = torch.randn(2, 5, 6, 3, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(3, 1, kernel_size, kernel_size, dtype=torch.float64, requires_grad=True)
    bias = torch.randn(3, dtype=torch.float64, requires_grad=True) if with_bias else None
    inputs = (x, weight) + ((bias,) if with_bias else ())
    torch.testing.assert_close(depthwise_conv2d_op(x, weight, bias), _reference(x, weight, bias))
    assert torch.autograd.gradcheck(depthwise_conv2d_op, inputs)
    assert torch.autograd.gradgradcheck(depthwise_conv2d_op, inputs)


def test_the_op_checks_out_under_torch_library_opcheck():
    """Schema, fake-tensor and autograd registrations agree with the implementation, with and without a bias."""
    x = torch.randn(2, 6, 5, 4, requires_grad=True)
    weight = torch.randn(4, 1, 3, 3, requires_grad=True)
    bias = torch.randn(4, requires_grad=True)
    torch.library.opcheck(torch.ops.lipsformer.depthwise_conv2d.default, (x, weight, bias))
    torch.library.opcheck(torch.ops.lipsformer.depthwise_conv2d.default, (x, weight, None))
    grad = torch.randn(2, 6, 5, 4)  # the backward op runs under no_grad: it has no gradient of its own
    for masks in [(True, True), (True, False), (False, True)]:
        torch.library.opcheck(torch.ops.lipsformer.depthwise_conv2d_backward.default,
                              (grad, x.detach(), weight.detach(), *masks))


def test_a_first_order_backward_is_one_op_as_atens_convolution_backward():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func.name())
            return func(*args, **(kwargs or {}))

    x = torch.randn(2, 7, 7, 8, requires_grad=True)
    weight = torch.randn(8, 1, 7, 7, requires_grad=True)
    bias = torch.randn(8, requires_grad=True)
    y = depthwise_conv2d_op(x, weight, bias)
    with Recorder() as recorder:
        y.backward(torch.ones_like(y))
    lipsformer_ops = [name for name in recorder.ops if name.startswith('lipsformer::')]
    assert lipsformer_ops == ['lipsformer::depthwise_conv2d_backward']
    assert not any(name.startswith('aten::convolution') for name in recorder.ops)


class _Convolve(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(6, 6, 7, padding=3, groups=6)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return depthwise_conv2d_op(x, self.conv.weight, self.conv.bias)


def test_compile_without_a_graph_break_and_export_keep_the_one_op():
    module = _Convolve()
    x = torch.randn(2, 9, 9, 6)
    exported = torch.export.export(module, (x,))
    targets = [node.target for node in exported.graph.nodes if node.op == 'call_function']
    assert torch.ops.lipsformer.depthwise_conv2d.default in targets
    assert torch.ops.aten.convolution.default not in targets
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(module, fullgraph=True, backend=backend)
    torch.testing.assert_close(compiled(x), module(x))
    assert len(graphs) == 1
    assert any(_is_the_op(node.target) for node in graphs[0].graph.nodes)
    inductor = torch.compile(module, fullgraph=True)
    x.requires_grad_()
    inductor(x).sum().backward()
    expected = x.detach().clone().requires_grad_()
    _reference(expected, module.conv.weight, module.conv.bias).sum().backward()
    torch.testing.assert_close(x.grad, expected.grad)


def test_bad_input_is_refused_with_what_was_wrong():
    x = torch.randn(1, 4, 4, 3)
    with pytest.raises(ValueError, match=r'\(C, 1, K, K\) weight with K in \(3, 5, 7\)'):
        depthwise_conv2d_op(x, torch.randn(3, 1, 4, 4))
    with pytest.raises(ValueError, match='NHWC map'):
        depthwise_conv2d_op(x.permute(0, 3, 1, 2)[0], torch.randn(3, 1, 3, 3))
    with pytest.raises(ValueError, match=r'bias of shape \(3,\)'):
        depthwise_conv2d_op(x, torch.randn(3, 1, 3, 3), torch.randn(4))
    with pytest.raises(TypeError, match='one dtype'):
        depthwise_conv2d_op(x.double(), torch.randn(3, 1, 3, 3))


def test_autocast_runs_the_op_in_its_dtype_as_f_conv2d():
    x = torch.randn(2, 5, 5, 4)
    weight = torch.randn(4, 1, 3, 3, requires_grad=True)
    with torch.autocast('cpu', dtype=torch.bfloat16):
        ours = depthwise_conv2d_op(x, weight, None)
        expected = _reference(x, weight, None)
    assert ours.dtype == expected.dtype == torch.bfloat16
    torch.testing.assert_close(ours, expected)
    ours.float().sum().backward()
    assert weight.grad.dtype == torch.float32

    def convolve_under_autocast(x: torch.Tensor) -> torch.Tensor:
        with torch.autocast('cpu', dtype=torch.bfloat16):
            return depthwise_conv2d_op(x, weight, None)

    compiled = torch.compile(convolve_under_autocast, fullgraph=True, backend='eager')(x)  # no graph break
    assert compiled.dtype == torch.bfloat16
    torch.testing.assert_close(compiled, expected)


class _OpRecorder:
    """Counts the ops a call dispatches, not those that a lipsformer op's own implementation dispatches."""

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                if recorder.inside:
                    return func(*args, **(kwargs or {}))
                recorder.ops.append((func.name(), args))
                recorder.inside = func.namespace == 'lipsformer'
                try:
                    return func(*args, **(kwargs or {}))
                finally:
                    recorder.inside = False

        self.ops = []
        self.inside = False
        self.mode = Mode()

    def count(self, name: str) -> int:
        return sum(op == name for op, _ in self.ops)

    def convolutions(self, kernel_size: tuple[int, int], depthwise: bool) -> int:
        """aten convolutions (forward) by ``kernel_size``, depthwise (groups > 1) or not."""
        return sum(op == 'aten::convolution' and tuple(args[1].shape[-2:]) == kernel_size and (args[8] > 1) == depthwise
                   for op, args in self.ops)

    def __enter__(self):
        self.mode.__enter__()
        return self

    def __exit__(self, *exc_info):
        self.mode.__exit__(*exc_info)


def test_the_cpu_training_fast_form_runs_the_op_and_timms_exportable_config_keeps_it_out():
    """The plain shortcut, as FX traces it, calls its modules; a fast form given under timm's exportable config is
    the plain module graph; a fast form given otherwise runs the op for each conv shortcut where a float32 backward
    will follow on the CPU, and the module's convolution without one."""
    import timm
    from timm.layers import set_layer_config
    from tiny_models import TINY_MODELS

    from lipsformer.fastpath import to_fast_form
    from lipsformer.layers import ConvShortcut
    shortcut = ConvShortcut(8, pointwise=True, alpha_init=0.1).eval()
    traced = torch.fx.symbolic_trace(shortcut)
    assert not any('lipsformer' in str(node.target) for node in traced.graph.nodes)
    assert {node.target for node in traced.graph.nodes if node.op == 'call_module'} >= {'dw', 'pw'}
    model = timm.create_model('lipsformer_swin_tiny', num_classes=5, **TINY_MODELS['lipsformer_swin_tiny'])
    shortcuts = sum(isinstance(module, ConvShortcut) for module in model.modules())
    x = torch.randn(1, 3, 64, 64)
    with set_layer_config(exportable=True):
        to_fast_form(model, 'cpu')
    with _OpRecorder() as recorder:
        model(x)
    assert recorder.count('lipsformer::depthwise_conv2d') == 0
    to_fast_form(model, 'cpu')
    with _OpRecorder() as recorder:
        model(x)
    assert recorder.count('lipsformer::depthwise_conv2d') == shortcuts > 0
    with _OpRecorder() as recorder, torch.no_grad():
        model(x)
    assert recorder.count('lipsformer::depthwise_conv2d') == 0
    assert recorder.convolutions((7, 7), depthwise=True) == shortcuts


@pytest.mark.parametrize('fast', [True, False])
def test_the_pointwise_conv_is_a_product_over_channels_and_a_hook_still_reaches_the_module(fast):
    from lipsformer.layers import ConvShortcut
    torch.manual_seed(0)
    shortcut = ConvShortcut(8, pointwise=True, alpha_init=0.3)
    x = torch.randn(2, 5, 6, 8)
    nchw = x.permute(0, 3, 1, 2)
    expected = x + shortcut.alpha(F.gelu(shortcut.pw(F.gelu(shortcut.dw(nchw)))).permute(0, 2, 3, 1))
    with form(shortcut, fast), _OpRecorder() as recorder:
        torch.testing.assert_close(shortcut(x), expected)
    convolutions = [args for op, args in recorder.ops if op == 'aten::convolution']
    assert [tuple(args[1].shape[-2:]) for args in convolutions] in ([(7, 7)], [])  # the depthwise conv alone
    seen = []
    shortcut.pw.register_forward_hook(lambda module, inputs, output: seen.append(inputs[0].shape))
    with form(shortcut, fast):
        torch.testing.assert_close(shortcut(x), expected)
    assert seen == [torch.Size([2, 8, 5, 6])]
