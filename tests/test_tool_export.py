"""Exports with a dynamic batch, on both families at 224 and at 256x320 (where Swin pads its windows and CSwin its
stripes), and on timm's Swin (the control, in the slow set): ``torch.export`` with ``Dim('batch', min=1, max=256)``,
and ONNX through both of torch's exporters, run with onnxruntime.

A model must not branch on the batch size (or the token count) in ``forward``: export either fails on the guard or
bakes one branch and the sample's batch into the graph. The exported program must also run with grad enabled (no
``out=`` operations, which autograd refuses).

The shapes are tiny (one block per stage) but keep the real windows and stripes. To keep the default run short, one
size per family runs by default; the other combinations, the controls and the dynamo ONNX exporter (slower than
any other tool here, most of its time going to decompositions) are marked slow.
"""
import copy
import warnings

import pytest
import timm
import torch
from forms_support import in_form
from tiny_models import EXPORT_MODELS, TIMM_SWIN
from torch.export import Dim

pytestmark = pytest.mark.usefixtures('one_thread')

SLOW = pytest.mark.slow
SWIN, CSWIN = 'lipsformer_swin_tiny', 'lipsformer_cswin_tiny'
SQUARE, PADDED = (224, 224), (256, 320)
BATCHES = (1, 5, 17)
SAMPLE_BATCH = 2
MAX_BATCH = 256


def _case(name: str, size: tuple[int, int], slow: bool = False):
    short = 'timm_swin' if name == TIMM_SWIN else name.split('_')[1]
    return pytest.param(name, size, id=f'{short}-{size[0]}x{size[1]}', marks=[SLOW] if slow else [])


CASES = [
    _case(SWIN, SQUARE), _case(CSWIN, PADDED),
    _case(SWIN, PADDED, slow=True), _case(CSWIN, SQUARE, slow=True),
    _case(TIMM_SWIN, SQUARE, slow=True), _case(TIMM_SWIN, PADDED, slow=True),
]


def _model(name: str, size: tuple[int, int]) -> torch.nn.Module:
    return timm.create_model(name, **EXPORT_MODELS[name], img_size=size, num_classes=10).eval()


def _images(batch: int, size: tuple[int, int]) -> torch.Tensor:
    return torch.randn(batch, 3, *size)


def _batch_dim() -> Dim:
    return Dim('batch', min=1, max=MAX_BATCH)


@pytest.fixture(scope='module')
def exported():
    """``exported(name, size)``: (eager model, ``torch.export`` program with a dynamic batch), each exported once per
    module (a failed export is raised again in every test that needs it)."""
    cache = {}

    def get(name: str, size: tuple[int, int]):
        if (name, size) not in cache:
            model = _model(name, size)
            try:
                program = torch.export.export(model, (_images(SAMPLE_BATCH, size),),
                                              dynamic_shapes={'x': {0: _batch_dim()}})
                cache[name, size] = (model, program)
            except Exception as error:  # noqa: BLE001  (raised again below, in each test that asks)
                cache[name, size] = error
        if isinstance(cache[name, size], Exception):
            raise cache[name, size]
        return cache[name, size]

    return get


def _out_variants(program: torch.export.ExportedProgram) -> list[str]:
    """The graph's operations with ``out=`` arguments (``aten.mul.out``, ``aten.gelu_backward.grad_input``, ...)."""
    found = set()
    for node in program.graph.nodes:
        if node.op == 'call_function' and isinstance(node.target, torch._ops.OpOverload):
            schema = node.target._schema
            if 'out' in schema.overload_name or any(arg.is_out for arg in schema.arguments):
                found.add(str(node.target))
    return sorted(found)


@pytest.mark.parametrize(('name', 'size'), CASES)
def test_torch_export_keeps_the_batch_dynamic(name, size, exported):
    model, program = exported(name, size)
    (input_name,) = program.graph_signature.user_inputs
    placeholder = next(n for n in program.graph.nodes if n.op == 'placeholder' and n.name == input_name)
    batch = placeholder.meta['val'].shape[0]
    assert isinstance(batch, torch.SymInt), f'the batch was specialised to {batch}'
    bounds = program.range_constraints[batch.node.expr]
    assert bounds.lower <= 1 and bounds.upper >= MAX_BATCH, bounds
    module = program.module()
    for batch_size in BATCHES:
        x = _images(batch_size, size)
        with torch.no_grad():
            out = module(x)
            expected = model(x)
        assert out.shape == (batch_size, 10)
        torch.testing.assert_close(out, expected, atol=1e-4, rtol=1e-4)


def _operations(program: torch.export.ExportedProgram) -> list[str]:
    return sorted(str(node.target) for node in program.graph.nodes if node.op == 'call_function')


@pytest.mark.parametrize(('name', 'size'), CASES[:2])
def test_a_fast_form_exports_its_plain_graph(name, size, exported):
    """``torch.export`` of a model in its fast form (``lipsformer.fastpath.to_fast_form``) traces the plain module
    graph: the same operations as the plain model's program, and the fast form's eager values."""
    model, program = exported(name, size)
    fast = in_form(copy.deepcopy(model), True, 'cpu')
    fast_program = torch.export.export(fast, (_images(SAMPLE_BATCH, size),), dynamic_shapes={'x': {0: _batch_dim()}})
    assert _operations(fast_program) == _operations(program)
    x = _images(3, size)
    with torch.no_grad():
        torch.testing.assert_close(fast_program.module()(x), fast(x), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(('name', 'size'), CASES)
def test_exported_program_runs_with_grad_enabled(name, size, exported):
    model, program = exported(name, size)
    assert not _out_variants(program), f'out= operations in the graph: {_out_variants(program)}'
    module = program.module()
    for batch_size in BATCHES:
        x = _images(batch_size, size)
        out = module(x)
        assert out.requires_grad
        torch.testing.assert_close(out, model(x), atol=1e-4, rtol=1e-4)
    # And it backpropagates as the eager model does.
    x = _images(BATCHES[1], size).requires_grad_()
    (grad,) = torch.autograd.grad(module(x).square().sum(), x)
    (expected,) = torch.autograd.grad(model(x).square().sum(), x)
    torch.testing.assert_close(grad, expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-3)


def _onnx_batch_dim(path: str) -> str | int:
    """The ONNX graph's input batch dimension: its symbolic name, or the number it was fixed to."""
    onnx = pytest.importorskip('onnx')
    dim = onnx.load(path, load_external_data=False).graph.input[0].type.tensor_type.shape.dim[0]
    return dim.dim_param or dim.dim_value


def _assert_onnxruntime_matches(path: str, model: torch.nn.Module, size: tuple[int, int]) -> None:
    onnxruntime = pytest.importorskip('onnxruntime')
    batch = _onnx_batch_dim(path)
    assert isinstance(batch, str) and batch, f'the ONNX graph fixed the batch to {batch}'
    session = onnxruntime.InferenceSession(path, providers=['CPUExecutionProvider'])
    for batch_size in (1, 3):
        x = _images(batch_size, size)
        (logits,) = session.run(None, {'x': x.numpy()})
        with torch.no_grad():
            expected = model(x)
        torch.testing.assert_close(torch.from_numpy(logits), expected, atol=1e-4, rtol=1e-4)


@SLOW
@pytest.mark.parametrize(('name', 'size'), CASES)
def test_onnx_dynamo_exporter_with_a_dynamic_batch_matches_onnxruntime(name, size, tmp_path):
    pytest.importorskip('onnxscript')
    model = _model(name, size)
    path = str(tmp_path / 'model.onnx')
    torch.onnx.export(model, (_images(SAMPLE_BATCH, size),), path, dynamo=True, input_names=['x'],
                      output_names=['logits'], dynamic_shapes={'x': {0: _batch_dim()}})
    _assert_onnxruntime_matches(path, model, size)


# tests/test_models.py exports both families through this exporter at 64x64; the padded stripes run by default here.
@pytest.mark.parametrize(('name', 'size'), [_case(CSWIN, PADDED), *[
    _case(name, size, slow=True)
    for name, size in ((SWIN, SQUARE), (SWIN, PADDED), (CSWIN, SQUARE), (TIMM_SWIN, SQUARE), (TIMM_SWIN, PADDED))]])
def test_onnx_torchscript_exporter_with_a_dynamic_batch_matches_onnxruntime(name, size, tmp_path):
    model = _model(name, size)
    path = str(tmp_path / 'model.onnx')
    with warnings.catch_warnings():
        warnings.simplefilter('ignore', DeprecationWarning)  # newer torch: the exporter's deprecation notice
        torch.onnx.export(model, (_images(SAMPLE_BATCH, size),), path, dynamo=False, input_names=['x'],
                          output_names=['logits'], dynamic_axes={'x': {0: 'batch'}, 'logits': {0: 'batch'}})
    _assert_onnxruntime_matches(path, model, size)
