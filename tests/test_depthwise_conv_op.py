"""The ``lipsformer::depthwise_conv2d`` custom op: NHWC depthwise convolution, one Triton kernel a pass on a GPU.

Its Triton kernels run here on CPU tensors under Triton's interpreter (``TRITON_INTERPRET=1``, which must be set
before Triton is imported: those checks run in a subprocess) against ``F.conv2d``; its PyTorch form, fake-tensor
registrations, autograd formula, compilation and export are checked in this process.
"""
import copy
import textwrap

import pytest
import torch
import torch.nn.functional as F
from forms_support import form, in_form
from process_support import assert_runs_under_triton_interpreter

from lipsformer.fastpath import depthwise_conv_op, to_plain_form
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


# The Triton kernels against F.conv2d in float64 (float32 and bf16 inputs, float32 reference on the same values).
# Tolerances: float32 within 1e-5 relative; bf16 within 2^-7 of the sum of the magnitudes that make each output (the
# op rounds its float32 sum to bf16 once: at most 2^-8 of |y| <= that sum; the reference sums in float64).
_TRITON_CHECKS = textwrap.dedent('''
    import torch
    import torch.nn.functional as F
    from lipsformer.fastpath import depthwise_conv_op

    torch.manual_seed(0)

    def reference(x, weight, bias):
        return F.conv2d(x.permute(0, 3, 1, 2), weight, bias, padding=weight.shape[-1] // 2,
                        groups=x.shape[-1]).permute(0, 2, 3, 1)

    def close(ours, expected, bound, dtype):
        error = (ours.double() - expected).abs()
        limit = 1e-5 * bound + 1e-6 if dtype == torch.float32 else 2.0 ** -7 * bound + 1e-6
        assert bool((error <= limit).all()), f'max error {error.max().item()}, at most {limit.max().item()} allowed'

    def check(x, kernel_size, with_bias=True, dtype=torch.float32):
        channels = x.shape[-1]
        weight = torch.randn(channels, 1, kernel_size, kernel_size).to(dtype)
        bias = torch.randn(channels).to(dtype) if with_bias else None
        x = x.to(dtype)
        assert depthwise_conv_op.depthwise_kernels_run_on(x), 'the Triton kernels should run under the interpreter'
        ours = [t.detach().clone().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        exact = [t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)]
        y = depthwise_conv_op.depthwise_conv2d_op(*ours)
        assert y.dtype == dtype and y.is_contiguous() and y.shape == x.shape
        expected = reference(*exact)
        magnitude = reference(*[t.detach().abs() if t is not None else None for t in exact])
        close(y, expected, magnitude, dtype)
        grad = torch.randn(x.shape, dtype=torch.float64).to(dtype).double()
        torch.autograd.backward(y, grad.to(dtype))
        torch.autograd.backward(expected, grad)
        x_bound = F.conv2d(grad.abs().permute(0, 3, 1, 2), exact[1].detach().abs().flip(-2, -1),
                           padding=kernel_size // 2, groups=channels).permute(0, 2, 3, 1)
        close(ours[0].grad, exact[0].grad, x_bound, dtype)
        w_bound = torch.nn.grad.conv2d_weight(exact[0].detach().abs().permute(0, 3, 1, 2), exact[1].shape,
                                              grad.abs().permute(0, 3, 1, 2), padding=kernel_size // 2,
                                              groups=channels)
        close(ours[1].grad, exact[1].grad, w_bound, dtype)
        if with_bias:
            close(ours[2].grad, exact[2].grad, grad.abs().sum((0, 1, 2)), dtype)

    # maps whose sides are not multiples of the tiles (8 wide, 64 pixels), every kernel size
    for size, kernel_size in [((1, 1), 7), ((7, 7), 7), ((14, 14), 5), ((3, 100), 3), ((9, 1), 3), ((1, 20), 7)]:
        check(torch.randn(2, *size, 3), kernel_size)
    check(torch.randn(1, 24, 24, 3), 3)                       # many tiles a map
    # channel counts that are and are not multiples of a channel block (32), up to several blocks
    for channels in (96, 200, 384):
        check(torch.randn(1, 3, 5, channels), 3)
    check(torch.randn(2, 6, 5, 40), 7, with_bias=False)
    # batch 0 and 1
    check(torch.randn(0, 7, 7, 8), 7)
    check(torch.randn(1, 7, 7, 8), 7)
    # strided inputs: a channels-first tensor viewed as NHWC, a slice of a wider map, a stripe of a map
    check(torch.randn(2, 8, 6, 5).permute(0, 2, 3, 1), 3)
    check(torch.randn(2, 7, 9, 24)[:, :, 1:8, 4:20], 5)
    # the weight gradient over several programs of several tiles each, the last program's chunk partial
    with depthwise_conv_op.using_tiling(depthwise_conv_op.DepthwiseTiling(weight_grad_programs=3)):
        check(torch.randn(3, 17, 9, 8), 7)
    # other tilings (the GPU check's sweep times them): tiles wider and narrower than the default's, more and fewer
    # channels a program than the map has, edges that cut a tile in both directions
    for tiling in (depthwise_conv_op.DepthwiseTiling(pixels=32, max_width=16, channels=64, warps=8,
                                                     weight_grad_pixels=8, weight_grad_channels=64,
                                                     weight_grad_warps=4, weight_grad_programs=5),
                   depthwise_conv_op.DepthwiseTiling(pixels=128, max_width=4, channels=16, warps=2,
                                                     weight_grad_pixels=2, weight_grad_channels=16)):
        with depthwise_conv_op.using_tiling(tiling):
            check(torch.randn(2, 11, 13, 40), 7)
            check(torch.randn(1, 5, 37, 20), 3, dtype=torch.bfloat16)
    # bf16 and fp16 inputs, summed in float32
    check(torch.randn(2, 14, 14, 40), 7, dtype=torch.bfloat16)
    check(torch.randn(2, 9, 3, 8), 3, dtype=torch.float16)
    print('triton ok')
''')


def test_a_tiling_is_checked_and_used_only_inside_its_block():
    from lipsformer.fastpath.depthwise_conv_op import DepthwiseTiling, using_tiling
    for wrong in ({'pixels': 48}, {'channels': 0}, {'warps': 64}, {'max_width': 128}, {'weight_grad_programs': 0},
                  {'weight_grad_pixels': 3}):
        with pytest.raises(ValueError, match='DepthwiseTiling'):
            DepthwiseTiling(**wrong)
    with pytest.raises(TypeError, match='takes a DepthwiseTiling'):
        with using_tiling({'pixels': 32}):
            pass
    wide = DepthwiseTiling(pixels=128, max_width=16)
    with pytest.raises(RuntimeError):
        with using_tiling(wide):
            assert depthwise_conv_op._tiling_in_use is wide
            raise RuntimeError('a failure inside the block')
    assert depthwise_conv_op._tiling_in_use == DepthwiseTiling()


def test_the_triton_kernels_under_the_interpreter():
    pytest.importorskip('triton')
    assert_runs_under_triton_interpreter(_TRITON_CHECKS, timeout_s=900)


# --- Where the models run the op ---------------------------------------------------------------------------------
# The op stands in for a depthwise conv only where its kernel runs (a GPU, or Triton's interpreter); here
# ``_INTERPRETED`` is set so that it applies on the CPU, where the op then computes with PyTorch's convolution: these
# tests check which calls reach it, the interpreter test above checks its kernels.

def _depthwise_modules(model: torch.nn.Module) -> list[str]:
    return [name for name, module in model.named_modules()
            if isinstance(module, torch.nn.Conv2d) and module.groups > 1]


def _lepe_pairs(model: torch.nn.Module) -> int:
    """CSwin mixers with two branches: on a square map their fast form runs both LePE convolutions as one."""
    return sum(1 for module in model.modules() if getattr(module, 'two_branches', False))


def _one_token_lepe_pairs(model: torch.nn.Module) -> int:
    """Those of :func:`_lepe_pairs` with stripes one token wide, which convolve by a 1x3 kernel (not the op's)."""
    return sum(1 for module in model.modules() if getattr(module, 'two_branches', False) and module.split_size == 1)


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


@pytest.fixture
def kernel_on_cpu(monkeypatch):
    """The op's kernel switched on (``set_fast_path(True)``) and applying on the CPU."""
    from lipsformer.fastpath import set_fast_path
    monkeypatch.setattr(depthwise_conv_op, '_INTERPRETED', True)
    monkeypatch.setattr(depthwise_conv_op, '_TRITON_INSTALLED', True)
    with set_fast_path(True):
        yield


def _tiny(name: str) -> torch.nn.Module:
    import timm
    from tiny_models import TINY_MODELS
    torch.manual_seed(0)
    return timm.create_model(name, num_classes=5, drop_path_rate=0.0, **TINY_MODELS[name])


@pytest.mark.parametrize('name', ['lipsformer_swin_tiny', 'lipsformer_cswin_tiny'])
def test_every_depthwise_conv_of_a_block_runs_the_op_in_the_fast_form_and_the_compiled_plain_graph(
        name, kernel_on_cpu):
    model = in_form(_tiny(name), True)
    plain = to_plain_form(copy.deepcopy(model))
    x = torch.randn(2, 3, 64, 64)
    convs = _depthwise_modules(model)
    # every conv shortcut's dw and, in CSwin, every branch's LePE
    assert all(n.endswith('.dw') or n.endswith('.lepe') for n in convs) and any(n.endswith('.dw') for n in convs)
    with _OpRecorder() as recorder:
        logits = model(x)
        logits.logsumexp(-1).sum().backward()
    # a square map's two LePE convolutions are one in the fast form, a 1x3 one for stripes one token wide
    calls = len(convs) - _lepe_pairs(model) - _one_token_lepe_pairs(model)
    assert recorder.count('lipsformer::depthwise_conv2d') == calls
    assert recorder.count('lipsformer::depthwise_conv2d_backward') == calls
    assert not any(recorder.convolutions((k, k), depthwise=True) for k in (3, 7))
    assert recorder.convolutions((1, 3), depthwise=True) == _one_token_lepe_pairs(model) == ('cswin' in name)
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    plain_logits = plain(x)
    plain_logits.logsumexp(-1).sum().backward()
    torch.testing.assert_close(logits, plain_logits, rtol=1e-5, atol=1e-5)
    for n, p in plain.named_parameters():
        torch.testing.assert_close(grads[n], p.grad, rtol=1e-4, atol=1e-5, msg=n)
    # compiled, the blocks' plain forward runs (the fast form steps aside), its convolutions the op: one op per conv
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    torch._dynamo.reset()
    compiled_logits = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(compiled_logits, logits, rtol=1e-5, atol=1e-5)
    in_graphs = sum(_is_the_op(node.target) for graph in graphs for node in graph.graph.nodes)
    assert in_graphs == len(convs)


def test_cswin_merges_are_not_depthwise_and_keep_their_convolution(kernel_on_cpu):
    model = in_form(_tiny('lipsformer_cswin_tiny').eval(), True)
    with _OpRecorder() as recorder, torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    assert recorder.convolutions((2, 2), depthwise=False) == 3


def test_a_hooked_or_wrapped_depthwise_conv_is_called_as_its_module(kernel_on_cpu):
    model = in_form(_tiny('lipsformer_cswin_tiny').eval(), True)
    convs = _depthwise_modules(model)
    seen = []
    hooked = model.stages[0].blocks[0].conv_shortcuts[0].dw
    handle = hooked.register_forward_pre_hook(lambda module, inputs: seen.append(inputs[0].shape))
    with _OpRecorder() as recorder, torch.no_grad():
        model(torch.randn(1, 3, 64, 64))
    handle.remove()
    assert seen == [torch.Size([1, 16, 16, 16])]  # NCHW, as nn.Conv2d takes it
    calls = len(convs) - 1 - _lepe_pairs(model) - _one_token_lepe_pairs(model)
    assert recorder.count('lipsformer::depthwise_conv2d') == calls


def test_the_kernel_is_the_fast_form_s_and_timms_exportable_config_keeps_it_out(kernel_on_cpu):
    """The plain shortcut, as FX traces it, calls its modules; a fast form given under timm's exportable config is
    the plain module graph; a fast form given otherwise runs the op."""
    from timm.layers import set_layer_config

    from lipsformer.fastpath import to_fast_form
    from lipsformer.layers import ConvShortcut
    shortcut = ConvShortcut(8, pointwise=True, alpha_init=0.1).eval()
    traced = torch.fx.symbolic_trace(shortcut)
    assert not any('lipsformer' in str(node.target) for node in traced.graph.nodes)
    assert {node.target for node in traced.graph.nodes if node.op == 'call_module'} >= {'dw', 'pw'}
    x = torch.randn(1, 5, 5, 8)
    with set_layer_config(exportable=True):
        to_fast_form(shortcut, 'cpu')
    with _OpRecorder() as recorder:
        shortcut(x)
    assert recorder.count('lipsformer::depthwise_conv2d') == 0
    to_fast_form(shortcut, 'cpu')
    with _OpRecorder() as recorder:
        shortcut(x)
    assert recorder.count('lipsformer::depthwise_conv2d') == 1


@pytest.mark.parametrize('name', ['lipsformer_swin_tiny', 'lipsformer_cswin_tiny'])
def test_the_kernel_is_off_by_default_where_no_gpu_measured_it(name, monkeypatch):
    """Without ``set_fast_path(True)`` a fast form calls the modules: the op becomes a device's default only once
    docs/performance.md measures it faster there (``KERNEL_DEFAULT_DEVICES``)."""
    from lipsformer.fastpath import KERNEL_DEFAULT_DEVICES, to_fast_form
    monkeypatch.setattr(depthwise_conv_op, '_INTERPRETED', True)
    monkeypatch.setattr(depthwise_conv_op, '_TRITON_INSTALLED', True)
    assert 'cpu' not in KERNEL_DEFAULT_DEVICES['depthwise_conv2d']
    with _OpRecorder() as recorder, torch.no_grad():
        to_fast_form(_tiny(name).eval(), 'cpu')(torch.randn(1, 3, 64, 64))
    assert recorder.count('lipsformer::depthwise_conv2d') == 0


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
