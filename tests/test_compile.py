"""``torch.compile`` of both families: one graph (``fullgraph=True``) with a dynamic batch for the training step
(forward and backward) and for evaluation, equal to eager in float32 (logits and every parameter gradient).

Eager runs the package's fast path (its lean autograd Functions); under dynamo the fast path steps aside
(:mod:`lipsformer.fastpath.switch`) and inductor compiles the plain module graph, so the comparison also holds the
two paths to the same function. Small widths here, the default widths in the slow suite.
"""
import pytest
import timm
import torch
from forms_support import in_form
from tiny_models import TINY_MODELS

from lipsformer.training.compilation import CompiledDropPath, compile_regions

RELATIVE_TOLERANCE = 1e-4


def _relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The error of a whole tensor relative to its size (a norm ratio: entries near zero do not dominate)."""
    return ((actual - expected).norm() / expected.norm().clamp(min=1e-30)).item()


def _train_step(model: torch.nn.Module, forward, x: torch.Tensor) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Logits of a training forward and the gradient of every parameter for a fixed weighting of them."""
    model.zero_grad(set_to_none=True)
    logits = forward(x)
    weights = torch.linspace(-1, 1, logits.numel()).reshape(logits.shape)
    (logits * weights).sum().backward()
    return logits.detach(), {name: p.grad.clone() for name, p in model.named_parameters()}


def _assert_compiled_equals_eager(name: str, kwargs: dict, batches: tuple[int, ...], resolution: int) -> None:
    torch._dynamo.reset()
    # the fast form eager; compiled, the plain graph it steps aside for
    model = in_form(timm.create_model(name, **kwargs, num_classes=10, drop_path_rate=0.0), True)
    compiled = torch.compile(model, fullgraph=True)  # fullgraph: a graph break is an error
    inputs = [torch.randn(batch, 3, resolution, resolution) for batch in batches]
    for x in inputs:
        torch._dynamo.mark_dynamic(x, 0)  # the batch is symbolic; a graph that specialises it raises
    model.train()
    for index, x in enumerate(inputs):
        with torch._dynamo.config.patch(error_on_recompile=index > 0):  # one training graph for every batch size
            compiled_logits, compiled_grads = _train_step(model, compiled, x)
        eager_logits, eager_grads = _train_step(model, model, x)
        assert _relative_error(compiled_logits, eager_logits) < RELATIVE_TOLERANCE
        assert compiled_grads.keys() == eager_grads.keys()
        errors = {key: _relative_error(compiled_grads[key], eager_grads[key]) for key in eager_grads}
        worst = max(errors, key=errors.get)
        assert errors[worst] < RELATIVE_TOLERANCE, f'{worst}: relative gradient error {errors[worst]:.2e}'
    model.eval()
    with torch.no_grad():
        for index, x in enumerate(inputs):
            with torch._dynamo.config.patch(error_on_recompile=index > 0):  # and one evaluation graph
                assert _relative_error(compiled(x), model(x)) < RELATIVE_TOLERANCE


@pytest.mark.parametrize('name', TINY_MODELS)
def test_one_graph_with_a_dynamic_batch_trains_and_evaluates_as_eager(name, one_thread):
    _assert_compiled_equals_eager(name, TINY_MODELS[name], batches=(2, 3), resolution=64)


@pytest.mark.slow
@pytest.mark.parametrize('name', TINY_MODELS)
def test_one_graph_at_the_default_widths_trains_and_evaluates_as_eager(name):
    _assert_compiled_equals_eager(name, {}, batches=(2, 3), resolution=224)


def _graphs_and_frames(name: str, depths: tuple[int, ...]) -> tuple[int, int]:
    """Graphs dynamo captured, and frames it compiled, for a training step and an evaluation of a regionally compiled
    model (aot_eager: the graphs inductor would compile, forward and backward, without compiling them)."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    kwargs = dict(TINY_MODELS[name], depths=depths)
    model = timm.create_model(name, **kwargs, num_classes=10, drop_path_rate=0.1)  # a rate of its own per block
    assert compile_regions(model, backend='aot_eager') == sum(depths)
    x = torch.randn(2, 3, 64, 64)
    model.train()
    model(x).sum().backward()
    assert all(parameter.grad is not None for parameter in model.parameters())
    model.eval()
    with torch.no_grad():
        model(x)
    counters = torch._dynamo.utils.counters
    assert not counters['graph_break']
    return counters['stats']['unique_graphs'], counters['frames']['ok']


@pytest.mark.parametrize('name', TINY_MODELS)
def test_regional_compilation_compiles_a_block_once_per_stage_shape(name, one_thread):
    limit_name = 'recompile_limit' if hasattr(torch._dynamo.config, 'recompile_limit') else 'cache_size_limit'
    # compile_regions raises dynamo's recompilation limit for the process; the test puts it back
    with torch._dynamo.config.patch({limit_name: getattr(torch._dynamo.config, limit_name)}):
        shallow = _graphs_and_frames(name, depths=(1, 1, 1, 1))
        deep = _graphs_and_frames(name, depths=(2, 2, 6, 2))
    # four stage shapes, each compiled for training and for evaluation, whatever the depth: no block recompiles for
    # its own stochastic-depth rate or position, and none falls back to eager at dynamo's recompilation limit
    assert shallow == deep == (8, 8)


def test_the_compiled_drop_path_keeps_a_sample_with_its_probability_and_scales_it():
    module = CompiledDropPath(0.25)
    x = torch.ones(20000, 2, 3)
    assert module.eval()(x) is x and not module.state_dict()  # identity in evaluation; no state to save
    kept = module.train()(x)
    assert kept.unique().tolist() == [0.0, pytest.approx(1 / 0.75)]
    assert (kept == kept[:, :1, :1]).all()  # a whole sample is kept or dropped
    assert abs((kept[:, 0, 0] > 0).float().mean().item() - 0.75) < 0.02  # 8 standard deviations
    assert CompiledDropPath(0.25, scale_by_keep=False).train()(x).unique().tolist() == [0.0, 1.0]
    assert torch.equal(CompiledDropPath(0.0).train()(x), x)
