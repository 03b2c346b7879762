"""Closed-form Lipschitz bounds of attention kernels, per head, from the theorems they come from.

Every function takes the norms of one head's projections and returns an upper bound on the 2-norm (Frobenius over
tokens) Lipschitz constant of that head as a map of its input tokens. Multi-head attention concatenates heads of the
same input, so its constant is at most sqrt(sum_h L_h^2) times the output projection's norm.

- Kim et al. (ICML 2021), Theorem 3.2: L2 attention with tied queries and keys, c(N) = W0((N - 1) / e).
- Dasoulas et al. (ICML 2021), Corollary 2: LipschitzNorm attention, e^sqrt(3) sqrt(m / n) + 2 sqrt(6).
- SCSA (LipsFormer's section 4.1.2, the setting of its Theorem 1: l2-normalised q, k and v, temperature tau, output
  scale nu): the bound of :func:`scsa_head_bound`, derived in its docstring, which also holds with an additive
  positional bias.
"""
import math

__all__ = [
    'DASOULAS_SELF_ATTENTION', 'dasoulas_bound', 'kim_c', 'kim_l2_head_bound', 'kim_mha_bound_2',
    'kim_mha_bound_inf', 'lambert_w0', 'scsa_head_bound',
]


def lambert_w0(x: float) -> float:
    """The principal branch of the Lambert W function, W0(x) e^W0(x) = x, for x >= 0 (Halley's iteration)."""
    if x < 0:
        raise ValueError(f'lambert_w0 is implemented for x >= 0, got {x}')
    w = math.log1p(x) if x < math.e else math.log(x) - math.log(math.log(x))
    for _ in range(100):
        exp_w = math.exp(w)
        f = w * exp_w - x
        step = f / (exp_w * (w + 1) - (w + 2) * f / (2 * w + 2))
        w -= step
        if abs(step) <= 1e-15 * max(1.0, abs(w)):
            break
    return w


def kim_c(num_tokens: int) -> float:
    """c(N) = W0((N - 1) / e) of Kim et al.'s Theorem 3.2 (<= log N; the paper's W0(N / e) is off by one)."""
    return lambert_w0((num_tokens - 1) / math.e)


def kim_l2_head_bound(num_tokens: int, query_norm: float, value_map_norm: float) -> float:
    """2-norm bound of one tied L2 head P(Y) Y M with Y = X W^Q (our parametrisation, see ``L2Attention``).

    Kim's Theorem 3.2 for the head as a map of Y (D = D/H = d, W^Q = W^V = W^O = I) gives
    sqrt(N) / sqrt(d) (4 c(N) + 1) for P Y / sqrt(d); the head is sqrt(d) times that followed by M, preceded by W^Q.

    Args:
        num_tokens: N, tokens that attend to each other (a window or a stripe).
        query_norm: ||W^Q_h||_2.
        value_map_norm: ||M_h||_2.
    """
    return math.sqrt(num_tokens) * (4 * kim_c(num_tokens) + 1) * query_norm * value_map_norm


def kim_mha_bound_2(num_tokens: int, head_dim: int, query_norms, value_norms, out_norm: float) -> float:
    """Kim et al.'s Theorem 3.2 in the 2-norm for L2-MHA with W^V_h (D x D/H) and W^O, as printed:

        sqrt(N) / sqrt(D/H) (4 c(N) + 1) sqrt(sum_h ||W^Q_h||_2^2 ||W^V_h||_2^2) ||W^O||_2
    """
    heads = math.sqrt(sum(q ** 2 * v ** 2 for q, v in zip(query_norms, value_norms)))
    return math.sqrt(num_tokens) / math.sqrt(head_dim) * (4 * kim_c(num_tokens) + 1) * heads * out_norm


def kim_mha_bound_inf(num_tokens: int, head_dim: int, query_inf_norms, query_t_inf_norms, value_t_inf_norms,
                      out_t_inf_norm: float) -> float:
    """Kim et al.'s Theorem 3.2 in the inf-norm (||.||_inf: largest absolute row sum of the matrix given):

        (4 c(N) + 1 / sqrt(D/H)) ||W^O^T||_inf max_h ||W^Q_h||_inf ||W^Q_h^T||_inf max_h ||W^V_h^T||_inf
    """
    query = max(a * b for a, b in zip(query_inf_norms, query_t_inf_norms))
    return (4 * kim_c(num_tokens) + 1 / math.sqrt(head_dim)) * out_t_inf_norm * query * max(value_t_inf_norms)


DASOULAS_SELF_ATTENTION = math.exp(math.sqrt(3)) + 2 * math.sqrt(6)  # 10.55, Corollary 2 with m = n


def dasoulas_bound(num_queries: int, num_keys: int) -> float:
    """Dasoulas et al.'s Corollary 2: Lip_F of LipschitzNorm attention in (Q, K, V), e^sqrt(3) sqrt(m/n) + 2 sqrt(6)."""
    return math.exp(math.sqrt(3)) * math.sqrt(num_queries / num_keys) + 2 * math.sqrt(6)


def scsa_head_bound(num_tokens: int, tau: float, nu: float, normalize_lipschitz: float, query_norm: float,
                    key_norm: float, value_norm: float) -> float:
    """2-norm bound of one SCSA head with l2-normalised q, k and v (LipsFormer's Theorem 1 setting).

    Derivation. Let n(.) be the normalisation (Lipschitz constant L_n: 1/eps for ``F.normalize``'s y / max(|y|, eps),
    1/sqrt(eps) for the paper's y / sqrt(|y|^2 + eps)), q_i = n(W^Q x_i), likewise k_j and v_j, so |q|, |k|, |v| <= 1.
    Output row i is nu sum_j P_ij v_j with P = softmax(tau Q K^T + B) row-stochastic for any additive bias B. Then

        d out_i = nu sum_j P_ij dv_j + nu sum_j P_ij dS_ij (v_j - sum_k P_ik v_k),     dS_ij = tau (dq_i.k_j + q_i.dk_j)

    The first term over all rows is P dV, and ||P||_2 <= sqrt(||P||_1 ||P||_inf) <= sqrt(N); in the second,
    |v_j - sum_k P_ik v_k| <= 2 and |dS_ij| <= tau (|dq_i| + |dk_j|). With a_i = |dx_i|,

        |d out| <= nu L_n (sqrt(N) |W^V| + 2 tau (|W^Q| + sqrt(N) |W^K|)) |dX|_F.

    At X = 0 the Jacobian of the paper's form is nu sigma_max(W^V) / sqrt(eps) (by differentiation there), below this
    bound.
    """
    root_n = math.sqrt(num_tokens)
    return nu * normalize_lipschitz * (root_n * value_norm + 2 * abs(tau) * (query_norm + root_n * key_norm))
