"""Parameter and MAC counts (lipsformer.instruments.complexity) checked against hand-derived formulas and published
numbers."""
import functools
import subprocess
import sys
from collections.abc import Callable

import pytest
import timm
import torch
import torch.nn.functional as F
from timm.layers import set_fused_attn, use_fused_attn
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

import lipsformer  # noqa: F401  (registers the lipsformer models)
from lipsformer.instruments.complexity import (
    SDPA_FLOP_FORMULAS,
    build_model,
    complexity_table,
    main,
    model_complexity,
)
from lipsformer.weights.model_names import expand_model_names

aten = torch.ops.aten


class TinyNet(nn.Module):
    """Depthwise 3x3 conv -> tokens -> Linear(16, 32) -> 4-head self-attention (qkv, attention, proj)."""

    def __init__(self, in_chans: int = 16, fused: bool = True) -> None:
        super().__init__()
        self.fused = fused
        self.dwconv = nn.Conv2d(in_chans, 16, 3, padding=1, groups=16)
        self.embed = nn.Linear(16, 32)
        self.qkv = nn.Linear(32, 96)
        self.proj = nn.Linear(32, 32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = self.embed(self.dwconv(x).flatten(2).transpose(1, 2))  # (B, 16 tokens, 32)
        q, k, v = self.qkv(tokens).reshape(x.shape[0], -1, 3, 4, 8).permute(2, 0, 3, 1, 4)
        if self.fused:
            out = F.scaled_dot_product_attention(q, k, v)
        else:
            out = (q @ k.transpose(-2, -1) * 8 ** -0.5).softmax(-1) @ v
        return self.proj(out.transpose(1, 2).flatten(2))


# Per image, by hand: an output element of a depthwise conv costs (in_channels / groups) * 3 * 3 = 9 MACs, a token
# through Linear(i, o) costs i * o, attention costs heads * L * L * head_dim for q k^T and again for attn @ v.
TINY_NET_MACS = (16 * 4 * 4 * 9 + 16 * 16 * 32 + 16 * 32 * 96 + 2 * 4 * 16 * 16 * 8 + 16 * 32 * 32)
TINY_NET_PARAMS = (16 * 9 + 16) + (16 * 32 + 32) + (32 * 96 + 96) + (32 * 32 + 32)


@pytest.mark.parametrize('device', ['meta', 'cpu'])
@pytest.mark.parametrize('fused', [True, False])
def test_hand_counted_conv_linear_attention(device, fused):
    info = model_complexity(functools.partial(TinyNet, fused=fused), img_size=4, batch_size=3, device=device,
                            in_chans=16)
    assert info['macs'] == TINY_NET_MACS
    assert info['gmacs'] == pytest.approx(TINY_NET_MACS / 1e9)
    assert info['gflops'] == pytest.approx(2 * TINY_NET_MACS / 1e9)
    assert info['params'] == TINY_NET_PARAMS
    assert info['input_size'] == (16, 4, 4) and info['batch_size'] == 3


def test_built_module_is_counted_where_it_lives_and_left_as_it_was():
    model = TinyNet().train()
    info = model_complexity(model, img_size=4, in_chans=16)
    assert info['macs'] == TINY_NET_MACS and info['model'] == 'TinyNet'
    assert model.training and all(parameter.requires_grad for parameter in model.parameters())


# Cross-attention with different q/k and v widths, so the formula's terms cannot be confused: by hand, per head,
# q k^T is Lq x d_qk times d_qk x Lk and attn @ v is Lq x Lk times Lk x d_v. A fused backward recomputes q k^T, then
# forms dV = P^T dO (Lk x Lq times Lq x d_v), dP = dO V^T (Lq x d_v times d_v x Lk), dQ = dS K and dK = dS^T Q.
BATCH, HEADS, LEN_Q, LEN_K, DIM_QK, DIM_V = 2, 3, 10, 14, 8, 5


def hand_counted_macs(dim_v: int) -> tuple[int, int]:
    """Forward and fused-backward MACs of attention over (BATCH, HEADS, LEN_Q/LEN_K, DIM_QK/dim_v) tensors."""
    forward = LEN_Q * DIM_QK * LEN_K + LEN_Q * LEN_K * dim_v
    backward = LEN_Q * DIM_QK * LEN_K + LEN_K * LEN_Q * dim_v + LEN_Q * dim_v * LEN_K + LEN_Q * LEN_K * DIM_QK + (
        LEN_K * LEN_Q * DIM_QK)
    return BATCH * HEADS * forward, BATCH * HEADS * backward


SDPA_MACS, SDPA_BACKWARD_MACS = hand_counted_macs(DIM_V)


def attention_inputs(device: str, dim_v: int = DIM_V, requires_grad: bool = False) -> tuple[torch.Tensor, ...]:
    shapes = [(BATCH, HEADS, LEN_Q, DIM_QK), (BATCH, HEADS, LEN_K, DIM_QK), (BATCH, HEADS, LEN_K, dim_v)]
    return tuple(torch.randn(shape, device=device, requires_grad=requires_grad) for shape in shapes)


def macs_by_op(run: Callable[[], object]) -> dict[str, int]:
    with FlopCounterMode(display=False, custom_mapping=SDPA_FLOP_FORMULAS) as counter:
        run()
    counts = counter.get_flop_counts().get('Global', {})
    return {str(op).removeprefix('aten.'): flops // 2 for op, flops in counts.items()}


@pytest.mark.parametrize('device', ['meta', 'cpu'])
@pytest.mark.parametrize('dim_v', [DIM_V, DIM_QK])  # on CPU, equal widths reach the fused kernel on current torch
@pytest.mark.parametrize('with_mask', [False, True])
def test_sdpa_counts_equal_explicit_matmuls(device, dim_v, with_mask):
    query, key, value = attention_inputs(device, dim_v)
    mask = torch.randn(1, HEADS, LEN_Q, LEN_K, device=device) if with_mask else None
    fused = macs_by_op(lambda: F.scaled_dot_product_attention(query, key, value, attn_mask=mask))

    def explicit():
        logits = query @ key.transpose(-2, -1)
        (logits if mask is None else logits + mask).softmax(-1) @ value

    assert sum(fused.values()) == sum(macs_by_op(explicit).values()) == hand_counted_macs(dim_v)[0], fused


# Every kernel F.scaled_dot_product_attention may dispatch to (the math one decomposes into counted matmuls).
FUSED_SDPA_KERNELS = ['_scaled_dot_product_flash_attention', '_scaled_dot_product_flash_attention_for_cpu',
                      '_scaled_dot_product_efficient_attention', '_scaled_dot_product_cudnn_attention',
                      '_scaled_dot_product_fused_attention_overrideable', '_scaled_dot_product_attention_math_for_mps']


@pytest.mark.parametrize('kernel', FUSED_SDPA_KERNELS)
def test_every_fused_attention_kernel_has_the_hand_counted_formula(kernel):
    if getattr(aten, kernel, None) is None:
        pytest.skip(f'torch {torch.__version__} has no {kernel}')
    query, key, value = (tensor.shape for tensor in attention_inputs('meta'))
    grad_out = torch.Size([BATCH, HEADS, LEN_Q, DIM_V])
    assert SDPA_FLOP_FORMULAS[getattr(aten, kernel)](query, key, value) == 2 * SDPA_MACS
    backward = getattr(aten, f'{kernel}_backward', None)  # MPS's kernel is inference only
    if backward is not None:
        assert SDPA_FLOP_FORMULAS[backward](grad_out, query, key, value) == 2 * SDPA_BACKWARD_MACS


# The kernels the host can run as the dispatcher runs them: the CUDA ones on meta (they have meta kernels), the
# CPU one on CPU. Backward goes through each kernel's own autograd formula. Their kernels need dim_v == dim_qk.
RUNNABLE_KERNELS = {
    '_scaled_dot_product_flash_attention': lambda q, k, v: aten._scaled_dot_product_flash_attention(q, k, v)[0],
    '_scaled_dot_product_efficient_attention':
        lambda q, k, v: aten._scaled_dot_product_efficient_attention(q, k, v, None, True)[0],
    '_scaled_dot_product_cudnn_attention':
        lambda q, k, v: aten._scaled_dot_product_cudnn_attention(q, k, v, None, True)[0],
}


@pytest.mark.parametrize('kernel', sorted(RUNNABLE_KERNELS) + ['_scaled_dot_product_flash_attention_for_cpu'])
def test_fused_attention_kernels_are_counted_with_the_formula(kernel):
    on_cpu = kernel not in RUNNABLE_KERNELS
    query, key, value = attention_inputs('cpu' if on_cpu else 'meta', DIM_QK, requires_grad=True)

    def forward_and_backward():
        if on_cpu:
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                out = F.scaled_dot_product_attention(query, key, value)
        else:
            out = RUNNABLE_KERNELS[kernel](query, key, value)
        out.backward(torch.ones_like(out))

    forward, backward = hand_counted_macs(DIM_QK)
    assert macs_by_op(forward_and_backward) == {kernel: forward, f'{kernel}_backward': backward}


def test_no_attention_kernel_of_this_torch_is_left_uncounted():
    # A kernel added by a later torch fails here until it has a formula (the math one decomposes into matmuls).
    kernels = {name for name in dir(aten) if name.startswith('_scaled_dot_product_')} - {
        '_scaled_dot_product_attention_math'}
    assert kernels - {str(op).removeprefix('aten.') for op in SDPA_FLOP_FORMULAS} == set()
    assert {name for name in kernels if not name.endswith('_backward')} <= set(FUSED_SDPA_KERNELS)


def test_timm_fused_and_explicit_attention_count_the_same():
    previous = use_fused_attn()
    try:
        counts = {}
        for fused in (True, False):
            set_fused_attn(fused)
            counts[fused] = model_complexity('test_vit', img_size=32)['macs']
    finally:
        set_fused_attn(previous)
    assert counts[True] == counts[False]
    assert model_complexity(timm.create_model('test_vit', img_size=32), img_size=32)['macs'] == counts[True]


def swin_macs(embed_dim: int, depths: list[int], window: int, img_size: int = 224, num_classes: int = 1000) -> int:
    """Swin-v1 MACs from the Swin paper's formulas: per block 12 h w C^2 (qkv, proj, MLP x4) + 2 M^2 h w C (attention);
    4x4 patch embedding from 3 channels; patch merging Linear(4C, 2C) on the halved grid; the classifier."""
    side = img_size // 4
    macs = side * side * embed_dim * 3 * 16
    for stage, depth in enumerate(depths):
        dim = embed_dim * 2 ** stage
        if stage:
            macs += side * side * 2 * dim * dim  # merging: (h w) * 4 C_prev * C, with C = 2 C_prev
        macs += depth * (12 * side * side * dim * dim + 2 * window ** 2 * side * side * dim)
        side //= 2
    return macs + embed_dim * 2 ** (len(depths) - 1) * num_classes


def test_timm_swin_tiny_matches_formula_and_paper():
    info = model_complexity('swin_tiny_patch4_window7_224')
    assert info['macs'] == swin_macs(96, [2, 2, 6, 2], 7)
    assert info['gmacs'] == pytest.approx(4.5, rel=0.01)  # Swin paper: 4.5G "FLOPs" (MACs)
    assert info['params'] / 1e6 == pytest.approx(28.29, rel=0.001)  # timm's model card
    assert all(parameter.is_meta for parameter in build_model('swin_tiny_patch4_window7_224').parameters())


def test_module_breakdown_adds_up():
    info = model_complexity('swin_tiny_patch4_window7_224', module_depth=2)
    by_module = info['gmacs_by_module']
    top_level = [name for name in by_module if '.' not in name]
    assert sorted(top_level) == ['head', 'layers', 'patch_embed']
    assert sum(by_module[name] for name in top_level) == pytest.approx(info['gmacs'])
    assert sum(by_module[f'layers.{stage}'] for stage in range(4)) == pytest.approx(by_module['layers'])


def test_billion_parameter_model_is_counted_without_its_weights():
    # 1.01 B float32 parameters would need 4 GB; on the meta device the whole process stays near its import size.
    code = ('import resource; from lipsformer.instruments.complexity import model_complexity; '
            "info = model_complexity('vit_giant_patch14_224'); "
            "print(info['params'], resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)")
    params, peak_kb = map(int, subprocess.run([sys.executable, '-c', code], check=True, capture_output=True,
                                              text=True).stdout.split())
    assert params / 1e6 == pytest.approx(1012.61, rel=1e-4)  # timm's model card
    assert peak_kb < 2 * 1024 * 1024


def test_meta_failure_says_how_to_count():
    class ItemInInit(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(3, int(torch.ones(()).item()) * 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.fc(x.mean((2, 3)))

    with pytest.raises(RuntimeError, match='device="cpu"'):
        model_complexity(ItemInInit, img_size=8)
    assert model_complexity(ItemInInit, img_size=8, device='cpu')['macs'] == 12


def test_img_size_reaches_size_dependent_models_and_is_dropped_for_cnns():
    assert model_complexity('test_vit', img_size=64)['input_size'] == (3, 64, 64)
    small, large = (model_complexity('resnet10t', img_size=size)['macs'] for size in (64, 128))
    assert large == pytest.approx(4 * small, rel=0.02)  # convs scale with pixels; the head is negligible
    assert model_complexity('resnet10t', img_size=None)['input_size'] == (3, 176, 176)  # the model's default


# The authors' code's counts (the paper prints them rounded: 31M / 5.0G for Swin-T) where known; for CSwin-S/-B GMACs
# and the 384 models, counted by running the authors' code (CSWinTransformer at commit 00acb80, LipsFormerSwin at
# HEAD, built with the paper's shapes on CPU) through model_complexity: CSwin-S 7.439, CSwin-B 16.226 (paper: 7.6 and
# 16.3), CSwin-B-384 50.699, Swin-B-384 96.147M / 51.603; Swin-L-384 scales the authors' Swin-L: 214.30M (table size
# (2*12-1)^2 per head).
AUTHORS_PARAMS_M_GMACS = {
    'lipsformer_swin_tiny': (30.91, 4.98),
    'lipsformer_swin_small': (54.48, 9.67),
    'lipsformer_swin_base': (96.01, 16.98),
    'lipsformer_swin_large': (214.13, 37.73),
    'lipsformer_swin_large_plus': (478.91, None),
    'lipsformer_swin_base_384': (96.147, 51.603),
    'lipsformer_swin_large_384': (214.30, None),
    'lipsformer_cswin_tiny': (23.78, 4.67),
    'lipsformer_cswin_small': (37.51, 7.439),
    'lipsformer_cswin_base': (83.05, 16.226),
    'lipsformer_cswin_base_384': (83.05, 50.699),
}


@pytest.mark.skipif(not timm.list_models('lipsformer*'), reason='lipsformer models not registered yet')
def test_every_lipsformer_model_has_a_reference():
    assert set(timm.list_models('lipsformer*')) == set(AUTHORS_PARAMS_M_GMACS)


@pytest.mark.parametrize('name', sorted(AUTHORS_PARAMS_M_GMACS))
def test_lipsformer_counts_match_authors(name):
    if not timm.is_model(name):
        pytest.skip(f'{name} not registered yet')
    params_m, gmacs = AUTHORS_PARAMS_M_GMACS[name]
    info = model_complexity(name, img_size=None)
    assert info['params'] / 1e6 == pytest.approx(params_m, rel=0.005)
    if gmacs is not None:
        assert info['gmacs'] == pytest.approx(gmacs, rel=0.02)


def test_cli_prints_the_counts(capsys):
    main(['--models', 'test_vit,resnet10t', '--img-size', '64', '--markdown'])
    lines = capsys.readouterr().out.strip().splitlines()
    assert lines[0] == '| model | input | params (M) | GMACs |'
    expected = [model_complexity(name, img_size=64) for name in ('test_vit', 'resnet10t')]
    assert lines[2:] == complexity_table(expected, markdown=True).splitlines()[2:]
    assert lines[3] == f'| resnet10t | 64x64 | {expected[1]["params"] / 1e6:.2f} | {expected[1]["gmacs"]:.2f} |'


def test_cli_and_resolver_reject_unknown_models(capsys):
    with pytest.raises(SystemExit):
        main(['--models', 'swin_tiny_patch4_window7_2244'])
    assert 'no timm model matches' in capsys.readouterr().err
    assert expand_model_names('swin_tiny_patch4_window7_224,swin_s3_t*') == [
        'swin_tiny_patch4_window7_224', *timm.list_models('swin_s3_t*')]
