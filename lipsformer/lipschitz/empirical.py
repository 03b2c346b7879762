"""Empirical Lipschitz estimates: lower bounds found by measuring Jacobians and difference quotients.

- :func:`jacobian_norm`: sigma_max of J_f(x) by power iteration on J^T J (a forward-mode jvp for J v, a reverse-mode
  vjp on a retained graph for J^T u). Every iterate ||J v|| (unit v) is a lower bound on the local constant.
- :func:`difference_quotient_ascent`: Kim et al.'s lower-bound search, maximising over inputs with Adam, on the
  difference quotient ||f(x + delta) - f(x)|| / ||delta|| (first derivatives only, so it scales to whole networks);
  every value it reaches is a lower bound on the global constant.
- :func:`jacobian_norm_ascent`: the same search on the exact Jacobian norm (any matrix norm), for small functions
  such as one attention layer (Kim et al., Figure 2).
"""
import contextlib
from collections.abc import Callable, Iterator

import torch
import torch.nn as nn

__all__ = ['capture_inputs', 'difference_quotient_ascent', 'explicit_attention', 'frozen', 'jacobian_norm',
           'jacobian_norm_ascent']

Function = Callable[[torch.Tensor], torch.Tensor]


@contextlib.contextmanager
def explicit_attention(model: nn.Module) -> Iterator[None]:
    """Run attention kernels on their explicit path (PyTorch's fused CPU kernel has no forward-mode derivative)."""
    kernels = [m for m in model.modules() if hasattr(m, 'fused_attn')]
    saved = [m.fused_attn for m in kernels]
    for m in kernels:
        m.fused_attn = False
    try:
        yield
    finally:
        for m, flag in zip(kernels, saved):
            m.fused_attn = flag


@contextlib.contextmanager
def frozen(model: nn.Module) -> Iterator[None]:
    """Switch off gradients of the parameters (derivatives are taken with respect to inputs only)."""
    saved = [(p, p.requires_grad) for p in model.parameters()]
    model.requires_grad_(False)
    try:
        yield
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)


def jacobian_norm(fn: Function, x: torch.Tensor, iterations: int = 10, tol: float = 1e-3,
                  seed: int = 0) -> tuple[float, torch.Tensor]:
    """Largest singular value of the Jacobian of ``fn`` at ``x``, by power iteration on J^T J.

    Args:
        fn: A function of one tensor (attention kernels inside must be on their explicit path).
        x: Where to take the Jacobian.
        iterations: Most power iterations.
        tol: Stop when the estimate changes by less than this (relative).
        seed: Seed of the random starting direction.

    Returns:
        The estimate (a lower bound, converging to sigma_max) and the unit input direction that attains it.
    """
    x = x.detach()
    generator = torch.Generator().manual_seed(seed)
    direction = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    with torch.enable_grad():
        probe = x.clone().requires_grad_(True)
        output = fn(probe)
    estimate, best = 0.0, direction / direction.norm()
    for _ in range(iterations):
        direction = direction / direction.norm()
        _, image = torch.func.jvp(fn, (x,), (direction,))
        new_estimate = image.norm().item()
        if new_estimate >= estimate:
            best = direction
        with torch.enable_grad():
            (direction,) = torch.autograd.grad(output, probe, image, retain_graph=True)
        converged = abs(new_estimate - estimate) <= tol * new_estimate
        estimate = max(estimate, new_estimate)
        if converged or direction.norm() == 0:
            break
    return estimate, best


def difference_quotient_ascent(fn: Function, x: torch.Tensor, direction: torch.Tensor, steps: int = 10,
                               lr: float = 0.05, relative_step: float = 1e-3) -> float:
    """Largest ||fn(x + delta) - fn(x)|| / ||delta|| found by Adam over the point and the direction of delta.

    Args:
        fn: The function (e.g. a whole network).
        x: Starting point.
        direction: Starting direction of delta (e.g. the top singular vector from :func:`jacobian_norm`).
        steps: Adam steps.
        lr: Adam learning rate (inputs are images of unit scale).
        relative_step: ||delta|| as a fraction of ||x||: small, so that the quotient follows ||J(x) delta||.

    Returns:
        The best quotient seen, a lower bound on the Lipschitz constant of ``fn``.
    """
    step = relative_step * x.detach().norm().clamp_min(1e-6)
    point = x.detach().clone().requires_grad_(True)
    delta_direction = direction.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([point, delta_direction], lr=lr, maximize=True)
    best = 0.0
    with torch.enable_grad():
        for _ in range(steps + 1):
            delta = step * delta_direction / delta_direction.norm()
            quotient = (fn(point + delta) - fn(point)).norm() / step
            best = max(best, quotient.item())
            optimizer.zero_grad()
            quotient.backward()
            optimizer.step()
    return best


def jacobian_norm_ascent(fn: Function, x: torch.Tensor, ord: float = float('inf'), steps: int = 300,
                         lr: float = 0.05) -> float:
    """Largest ``ord`` operator norm of the exact Jacobian of ``fn`` (flattened) found by Adam over inputs.

    For small functions only: the full Jacobian is built at every step. Returns the best norm seen.
    """
    def jacobian_matrix_norm(point: torch.Tensor) -> torch.Tensor:
        jacobian = torch.func.jacrev(fn)(point).reshape(fn(point).numel(), point.numel())
        return torch.linalg.matrix_norm(jacobian, ord=ord)

    point = x.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([point], lr=lr, maximize=True)
    best = 0.0
    with torch.enable_grad():
        for _ in range(steps + 1):
            value = jacobian_matrix_norm(point)
            best = max(best, value.item())
            optimizer.zero_grad()
            value.backward()
            optimizer.step()
    return best


@torch.no_grad()
def capture_inputs(model: nn.Module, modules: list[nn.Module], x: torch.Tensor) -> dict[int, torch.Tensor]:
    """The forward input of each of ``modules`` when ``model`` runs on ``x``, keyed by ``id(module)``."""
    captured: dict[int, torch.Tensor] = {}
    hooks = [m.register_forward_pre_hook(lambda module, args: captured.setdefault(id(module), args[0].detach()))
             for m in modules]
    try:
        model(x)
    finally:
        for hook in hooks:
            hook.remove()
    return captured
