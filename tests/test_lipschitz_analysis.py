"""lipsformer.lipschitz: the theorems' constants, operator norms, Jacobian estimates, the per-branch and Theorem 2
network bounds on real models (LipsFormer section 4.1.4 and Theorem 2), and the command line with its JSON."""
import json
import math
import os
import signal
import subprocess
import sys

import pytest
import safetensors.torch
import timm
import torch
import torch.nn as nn
import torch.nn.functional as F
from timm.models import save_for_hf
from tiny_models import TINY_CSWIN, TINY_MODELS
from torch.autograd.functional import jacobian

from lipsformer.layers import init_weights_
from lipsformer.lipschitz import (
    activation_lipschitz,
    analyze,
    conv_operator_norm,
    dasoulas_bound,
    jacobian_norm,
    kim_c,
    lambert_w0,
    reshaped_norm,
)
from lipsformer.lipschitz.empirical import capture_inputs, explicit_attention, frozen
from lipsformer.lipschitz.norms import conv_overlap_factor
from lipsformer.lipschitz.report_command import main

pytestmark = pytest.mark.usefixtures('one_thread')


def _sigma(matrix: torch.Tensor) -> float:
    return torch.linalg.matrix_norm(matrix, ord=2).item()


# --- constants ----------------------------------------------------------------------------------------------------

def test_theorem_constants_from_first_principles():
    assert lambert_w0(math.e) == pytest.approx(1.0, abs=1e-14)
    assert lambert_w0(1.0) == pytest.approx(0.5671432904097838, abs=1e-14)  # the omega constant
    for n in (2, 10, 100, 10 ** 4):
        c = kim_c(n)
        assert c * math.exp(c) == pytest.approx((n - 1) / math.e) and c <= math.log(n)
    assert 4 * kim_c(100) + 1 == pytest.approx(11.51, abs=5e-3)
    assert dasoulas_bound(8, 8) == pytest.approx(10.55, abs=5e-3)
    assert dasoulas_bound(32, 8) > dasoulas_bound(8, 8)


def test_activation_lipschitz_constants():
    """GELU's constants from its derivative: exact 1.1289 (at x = sqrt(2)), x sigmoid(1.702 x) 1.0998."""
    assert activation_lipschitz(nn.GELU()) == pytest.approx(1.1289, abs=1e-4)
    exact = 0.5 * (1 + math.erf(1.0)) + math.sqrt(2) * math.exp(-1.0) / math.sqrt(2 * math.pi)  # Phi + x phi
    assert activation_lipschitz(nn.GELU()) == pytest.approx(exact, abs=1e-8)
    assert activation_lipschitz(lambda x: x * torch.sigmoid(1.702 * x)) == pytest.approx(1.0998, abs=1e-4)
    assert activation_lipschitz(nn.ReLU()) == pytest.approx(1.0)


# --- operator norms and Jacobian estimates ------------------------------------------------------------------------

def _conv_matrix(conv: nn.Conv2d, size) -> torch.Tensor:
    apply = lambda x: F.conv2d(x, conv.weight.detach().double(), stride=conv.stride, padding=conv.padding,  # noqa
                               groups=conv.groups)
    x = torch.zeros(1, conv.in_channels, *size, dtype=torch.float64)
    return jacobian(apply, x).reshape(-1, x.numel())


@pytest.mark.parametrize('conv, size', [
    (nn.Conv2d(6, 6, 7, padding=3, groups=6), (9, 9)),  # Swin / CSwin conv shortcut
    (nn.Conv2d(6, 6, 7, padding=3, groups=6), (7, 1)),  # a stripe narrower than the kernel
    (nn.Conv2d(4, 4, 3, padding=1, groups=4), (5, 6)),  # LePE
    (nn.Conv2d(3, 5, 3, padding=1), (5, 6)),  # a dense conv
    (nn.Conv2d(3, 8, 4, stride=4), (8, 8)),  # patch embedding: patchwise
])
def test_conv_operator_norm_is_the_norm_of_the_conv_matrix(conv, size):
    """The power iteration finds the norm of the full convolution matrix; the reshaped weight can be far off, but
    never by more than sqrt(overlapping taps)."""
    init_weights_(conv, 'spectral')
    exact = _sigma(_conv_matrix(conv, size))
    assert conv_operator_norm(conv, size, iterations=2000, tol=1e-9) == pytest.approx(exact, rel=2e-4)
    assert exact <= conv_overlap_factor(conv) * reshaped_norm(conv.weight) * (1 + 1e-9)
    if conv.stride == conv.kernel_size:
        assert conv_operator_norm(conv, size) == pytest.approx(reshaped_norm(conv.weight))


def test_jacobian_power_iteration_matches_the_exact_singular_value():
    mlp = nn.Sequential(nn.Linear(6, 9), nn.GELU(), nn.Linear(9, 4)).double()
    x = torch.randn(3, 6, dtype=torch.float64)
    exact = _sigma(jacobian(mlp, x).reshape(12, 18))
    estimate, direction = jacobian_norm(mlp, x, iterations=200, tol=1e-12)
    assert estimate == pytest.approx(exact, rel=1e-6)
    assert direction.norm().item() == pytest.approx(1.0)


# --- bounds on real models ----------------------------------------------------------------------------------------

def _tiny(name, **kwargs):
    torch.manual_seed(0)
    return timm.create_model(name, **dict(TINY_MODELS[name], **kwargs))


@pytest.mark.parametrize('name, kwargs', [
    ('lipsformer_cswin_tiny', dict(attn_type='l2')),
    ('lipsformer_cswin_tiny', dict(attn_type='lipnorm')),
    ('lipsformer_swin_tiny', dict(v_norm=True, nu=1.0)),
    ('lipsformer_swin_tiny', dict(attn_type='l2', drop_path_rate=0.3)),
    ('lipsformer_cswin_tiny', dict(attn_type='l2', norm_position='pre')),
])
def test_theorem_2_at_initialisation_on_a_real_model(name, kwargs):
    """LipsFormer Theorem 2 at initialisation: measured Lipschitz estimate <= product bound <= exp(kappa sum alpha) x
    plain layers (the CenterNorm factors, stem, merges, pooling and head); every branch's estimate is below its own
    bound."""
    report = analyze(_tiny(name, **kwargs), iterations=6, ascent_steps=3, branch_iterations=4)
    empirical = report['empirical_lipschitz']
    assert 0 < empirical['power_iteration'] <= empirical['gradient_ascent']
    # In log10: SCSA's 1/eps factors take the v_norm model's bounds beyond float64.
    assert math.log10(empirical['gradient_ascent']) <= report['log10_product_bound']
    assert report['log10_product_bound'] <= report['log10_exp_kappa_bound'] + 1e-12
    plain = sum(math.log10(row['lipschitz_bound']) for row in report['plain_layers'])
    assert report['log10_exp_kappa_bound'] == pytest.approx(
        plain + report['kappa'] * report['sum_alpha'] / math.log(10), rel=1e-9)
    assert report['log10_product_bound'] == pytest.approx(
        plain + sum(math.log10(b['factor']) for b in report['branches']), rel=1e-9)
    for branch in report['branches']:
        assert 0 < branch['empirical'] <= branch['lipschitz_bound']
        assert branch['factor'] == pytest.approx(1 + branch['alpha'] * branch['lipschitz_bound'])
    center_norms = [row for row in report['plain_layers'] if row['kind'] == 'norm' and 'CenterNorm' in row['reason']]
    assert center_norms and all(row['lipschitz_bound'] > 1 for row in center_norms)
    expected = report['drop_path_expected_bound']
    assert expected['timm_rescaled'] == report['product_bound']
    if isinstance(expected['paper'], float):  # Appendix J: each factor is 1 with probability p
        rates = [b['drop_path'] for b in report['branches']]
        assert any(rates) and expected['paper'] == pytest.approx(report['plain_layers_bound'] * math.prod(
            1 + (1 - b['drop_path']) * b['alpha'] * b['lipschitz_bound'] for b in report['branches']), rel=1e-9)
        assert expected['paper'] < report['product_bound']


def test_bounds_name_what_is_not_lipschitz():
    """The authors' SCSA (v not normalised), dot product and LayerNorm have no bound: 'unbounded', not a number."""
    default = analyze(_tiny('lipsformer_swin_tiny'), empirical=False)
    assert math.isinf(default['product_bound']) and len(default['unbounded']) == 5  # every attention
    assert 'v_norm=False' in default['branches'][2]['reason']
    assert 1 < default['bounded_parts_product'] < 1e3  # what the rest of the network contributes
    dot = analyze(_tiny('lipsformer_cswin_tiny', attn_type='dot'), empirical=False)
    assert 'Kim et al. 2021, Theorem 3.1' in dot['branches'][2]['reason']
    layer = analyze(_tiny('lipsformer_cswin_tiny', attn_type='l2', norm_layer='layer'), empirical=False)
    assert layer['unbounded'][0] == 'patch_embed.norm' and 'LayerNorm' in layer['plain_layers'][1]['reason']
    swin_l2 = analyze(_tiny('lipsformer_swin_tiny', attn_type='l2'), empirical=False)
    assert swin_l2['not_proven'] and 'relative-position bias' in swin_l2['branches'][2]['reason']
    assert not analyze(_tiny('lipsformer_cswin_tiny', attn_type='l2'), empirical=False)['not_proven']


def test_pre_norm_blocks_bound_each_branch_with_its_norm():
    """x + alpha f(norm(x)): the norm is inside the branch, Lip <= 1 + alpha Lip(f) Lip(norm); no norm after it."""
    post = analyze(_tiny('lipsformer_cswin_tiny', attn_type='l2'), empirical=False)
    pre = analyze(_tiny('lipsformer_cswin_tiny', attn_type='l2', norm_position='pre'), empirical=False)
    assert not any('.blocks.' in row['name'] for row in pre['plain_layers'])
    assert pre['plain_layers'][-3]['name'] == 'norm' and 'CenterNorm' in pre['plain_layers'][-3]['reason']
    post_mlp, pre_mlp = (next(b for b in r['branches'] if b['name'] == 'stages.0.blocks.0.mlp') for r in (post, pre))
    assert pre_mlp['lipschitz_bound'] == pytest.approx(post_mlp['lipschitz_bound'] * 16 / 15)  # CenterNorm, D=16
    layer = analyze(_tiny('lipsformer_cswin_tiny', attn_type='l2', norm_layer='layer', norm_position='pre'),
                    empirical=False)
    assert all(math.isinf(b['lipschitz_bound']) for b in layer['branches'] if 'conv_shortcuts' not in b['name'])
    assert layer['log10_bounded_parts_product'] == pytest.approx(math.log10(layer['bounded_parts_product']))


def test_spectral_init_parts_have_unit_norm_and_operator_norms_differ():
    """Spectral init (LipsFormer 4.1.4, sigma_max = 1) on every Linear and Conv of a real LipsFormer-Swin as the
    analysis reports them; the true operator norm of an overlapping conv differs from its reshaped matrix."""
    report = analyze(_tiny('lipsformer_swin_tiny', attn_type='l2'), empirical=False)
    parts = [p for row in report['branches'] + report['plain_layers'] for p in row['parts']]
    assert len(parts) > 20
    assert [p['reshaped_norm'] for p in parts] == pytest.approx([1.0] * len(parts), rel=1e-6)
    depthwise = [p for p in parts if p['name'].endswith('.dw')]
    assert any(abs(p['operator_norm'] - 1) > 0.05 for p in depthwise)
    assert all(p['operator_norm'] <= 7 * p['reshaped_norm'] for p in depthwise)  # sqrt(7 x 7) overlapping taps


def _deep(**kwargs):
    torch.manual_seed(0)
    return timm.create_model('lipsformer_cswin_tiny', **dict(TINY_CSWIN, depths=(1, 1, 25, 1), drop_path_rate=0.0,
                                                             **kwargs)).eval()


def _stack_lipschitz(model, x):
    """Local Lipschitz estimate of the 25-block stage at its input for image x."""
    stack = model.stages[2].blocks
    with frozen(model), explicit_attention(model):
        stack_input = capture_inputs(model, [stack], x)[id(stack)]
        return jacobian_norm(stack, stack_input, iterations=8, tol=1e-3)[0]


def test_deep_model_forward_stability_at_inputs_scaled_by_1e3():
    """LipsFormer Table 3's stability claim, 25 blocks at init with inputs x 1e3: LipsFormer (SCSA, CenterNorm, alpha
    0.04) stays finite with a Lipschitz estimate that does not depend on the scale; the same stack with dot-product
    attention and LayerNorm in a standard residual (alpha 1, Xavier) has a several times larger estimate that grows
    with depth (LayerNorm keeps its activations finite, so the growth is in the Jacobian, not the output)."""
    x = torch.randn(1, 3, 64, 64)
    lipsformer = _deep(alpha_init=0.04)
    with torch.no_grad():
        assert torch.isfinite(lipsformer(1e3 * x)).all()
    scaled, plain = _stack_lipschitz(lipsformer, 1e3 * x), _stack_lipschitz(lipsformer, x)
    assert scaled == pytest.approx(plain, rel=0.2) and scaled < 3
    standard = dict(attn_type='dot', norm_layer='layer', weight_init='xavier', alpha_init=1.0)
    deep_standard = _stack_lipschitz(_deep(**standard), 1e3 * x)
    shallow_standard = _stack_lipschitz(timm.create_model('lipsformer_cswin_tiny', **dict(
        TINY_CSWIN, depths=(1, 1, 5, 1), drop_path_rate=0.0, **standard)).eval(), 1e3 * x)
    assert deep_standard > 4 * scaled
    assert deep_standard > 2 * shallow_standard


# --- command line -------------------------------------------------------------------------------------------------

def _tiny_cli_args(name='lipsformer_cswin_tiny', **extra):
    kwargs = dict(TINY_MODELS[name], **extra)
    img_size = kwargs.pop('img_size')
    items = [f'{k}={list(v) if isinstance(v, tuple) else v}' for k, v in kwargs.items()]
    return ['--model', name, '--img-size', str(img_size), '--model-kwargs', *items]


def test_cli_prints_the_table_and_writes_json(tmp_path, capsys):
    out = tmp_path / 'report.json'
    args = _tiny_cli_args(attn_type='lipnorm') + ['--json', str(out), '--iterations', '3', '--ascent-steps', '2']
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert 'Theorem 2 product bound' in printed and 'stages.2.blocks.1.attn' in printed
    report = json.loads(out.read_text())
    assert {'model', 'product_bound', 'exp_kappa_bound', 'empirical_lipschitz', 'branches'} <= set(report)
    assert report['model'] == 'lipsformer_cswin_tiny' and report['img_size'] == [64, 64]
    assert isinstance(report['product_bound'], float) and len(report['branches']) == 5 * 4
    assert report['empirical_lipschitz']['power_iteration'] <= report['product_bound']
    branch = report['branches'][2]
    assert {'alpha', 'lipschitz_bound', 'lipschitz_bound_reshaped', 'empirical', 'reason', 'parts'} <= set(branch)
    assert main(_tiny_cli_args() + ['--json', str(out), '--no-empirical']) == 0  # authors' SCSA: unbounded
    report = json.loads(out.read_text())
    assert report['product_bound'] == 'unbounded' and 'empirical_lipschitz' not in report


def test_cli_analyses_the_weights_of_a_checkpoint(tmp_path):
    model = _tiny('lipsformer_cswin_tiny', attn_type='l2')
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, nn.Linear):
                module.weight.mul_(2.0)  # trained weights: every Linear twice its init norm
    path = tmp_path / 'model.pth'
    torch.save({'model': model.state_dict()}, path)
    out = tmp_path / 'report.json'
    assert main(_tiny_cli_args(attn_type='l2') + ['--checkpoint', str(path), '--json', str(out),
                                                  '--no-empirical']) == 0
    report = json.loads(out.read_text())
    assert report['checkpoint'] == str(path)
    assert report['branches'][3]['parts'][0]['reshaped_norm'] == pytest.approx(2.0, rel=1e-6)  # mlp.fc1


def test_cli_reports_bad_input(tmp_path, capsys):
    assert main(_tiny_cli_args() + ['--checkpoint', str(tmp_path / 'missing.pth')]) == 2
    assert 'does not exist' in capsys.readouterr().err
    assert main(['--model', 'lipsformer_cswin_huge']) == 2
    assert 'lipsformer_cswin_tiny' in capsys.readouterr().err
    with pytest.raises(SystemExit, match='2'):
        main(_tiny_cli_args() + ['attn_type'])
    assert "--model-kwargs 'attn_type' is not KEY=VALUE" in capsys.readouterr().err
    assert main(_tiny_cli_args() + ['--img-size', '70']) == 2
    assert 'multiple of 32' in capsys.readouterr().err


def _export_with_ema(folder) -> tuple[float, float]:
    """A run folder whose export holds raw and EMA weights (the EMA's Linears half the raw ones' norm, as a smoother
    average would have), as train.py writes it; returns the raw and the EMA product bound."""
    raw = _tiny('lipsformer_cswin_tiny', attn_type='l2').eval()
    ema = _tiny('lipsformer_cswin_tiny', attn_type='l2').eval()
    with torch.no_grad():
        for module in ema.modules():
            if isinstance(module, nn.Linear):
                module.weight.mul_(0.5)
    export = folder / 'export' / 'best'
    save_for_hf(raw, str(export), safe_serialization=True)
    safetensors.torch.save_file(ema.state_dict(), str(export / 'model_ema.safetensors'))
    return (analyze(raw, empirical=False)['product_bound'], analyze(ema, empirical=False)['product_bound'])


def test_cli_reads_run_folders_exports_and_their_ema_weights(tmp_path, capsys):
    raw_bound, ema_bound = _export_with_ema(tmp_path / 'run')
    assert ema_bound < raw_bound / 2
    export = tmp_path / 'run' / 'export' / 'best'
    for args, bound, weights in (
            (['--checkpoint', str(tmp_path / 'run'), '--use-ema'], ema_bound,
             f'EMA weights: {export / "model_ema.safetensors"}'),
            (['--model', 'lipsformer_cswin_tiny', '--checkpoint', str(tmp_path / 'run')], raw_bound,
             str(export / 'model.safetensors')),
            (['--model', f'local-dir:{export}', '--use-ema'], ema_bound,
             f'EMA weights: {export / "model_ema.safetensors"}'),
            (['--model', f'local-dir:{export}'], raw_bound, str(export / 'model.safetensors'))):
        out = tmp_path / 'report.json'
        assert main([*args, '--no-empirical', '--json', str(out)]) == 0, args
        header = capsys.readouterr().out.splitlines()[0]
        assert header == f'Lipschitz analysis of lipsformer_cswin_tiny at 64x64 ({weights})', args
        report = json.loads(out.read_text())
        assert report['product_bound'] == pytest.approx(bound, rel=1e-6) and report['weights'] == weights, args
    assert main(['--model', 'lipsformer_cswin_tiny', '--use-ema']) == 2
    assert '--use-ema needs --checkpoint (or a local-dir: model)' in capsys.readouterr().err


def test_cli_model_kwargs_are_read_as_validate_reads_them(capsys):
    from lipsformer.evaluation.validate_command import build_validate_parser
    items = ['depths=1,1,2,1', 'attn_type=l2', 'split_size=(1,2,2,2)', 'embed_dim=16']
    assert main(['--model', 'lipsformer_cswin_tiny', '--img-size', '64', '--no-empirical', '--model-kwargs',
                 *items]) == 0
    report = capsys.readouterr().out
    assert 'stages.2.blocks.1.attn' in report and 'stages.2.blocks.2' not in report
    assert build_validate_parser().parse_args(['--model-kwargs', *items]).model_kwargs == dict(
        depths=(1, 1, 2, 1), attn_type='l2', split_size=(1, 2, 2, 2), embed_dim=16)
    for parse in (main, build_validate_parser().parse_args):  # the string 'false' would be true
        with pytest.raises(SystemExit, match='2'):
            parse(['--model', 'lipsformer_cswin_tiny', '--model-kwargs', 'v_norm=false'])
        assert "'v_norm=false': values are Python literals; write v_norm=False" in capsys.readouterr().err


def test_cli_refuses_models_it_cannot_analyse_in_one_line(capsys):
    assert main(['--model', 'resnet18', '--no-empirical']) == 2
    err = capsys.readouterr().err
    assert err.strip().splitlines() == [
        'python -m lipsformer.lipschitz: error: resnet18 is not a LipsFormer model: the analysis bounds the weighted '
        'residual branches of lipsformer_swin_* and lipsformer_cswin_* models only']


def test_cli_json_file_is_checked_before_the_analysis_and_a_failed_write_keeps_the_report(tmp_path, capsys,
                                                                                           monkeypatch):
    assert main([*_tiny_cli_args(), '--no-empirical', '--json', str(tmp_path)]) == 2
    assert f'--json {str(tmp_path)!r} cannot be written: it is a folder' in capsys.readouterr().err

    def full_disk(path, data):
        raise OSError(28, 'No space left on device', path)

    monkeypatch.setattr('lipsformer.lipschitz.report_command.write_json', full_disk)
    out = str(tmp_path / 'report.json')
    assert main([*_tiny_cli_args(), '--no-empirical', '--json', out]) == 4
    printed, err = capsys.readouterr()
    assert 'Theorem 2 product bound' in printed
    assert f'could not be written to --json {out!r}: No space left on device; it is printed above (free space' in err


def test_cli_json_file_in_a_folder_that_does_not_exist_yet_is_written_there(tmp_path, capsys):
    """--json NEW_FOLDER/report.json: the folder is made, as validate.py and the benchmark make theirs."""
    out = tmp_path / 'new' / 'deeper' / 'report.json'
    assert main([*_tiny_cli_args(), '--no-empirical', '--json', str(out)]) == 0
    assert json.loads(out.read_text())['model'] == 'lipsformer_cswin_tiny'
    assert capsys.readouterr().err == ''


def test_cli_ctrl_c_keeps_the_bounds_and_exits_130(tmp_path, capsys, monkeypatch):
    """Ctrl-C during the empirical estimates: the bounds computed before them are printed and in --json (complete
    false), and one line ends the run with exit 130; before the bounds, the line says nothing was written."""
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt
    monkeypatch.setattr('lipsformer.lipschitz.analysis._empirical', interrupted)
    out = tmp_path / 'report.json'
    assert main([*_tiny_cli_args(attn_type='lipnorm'), '--json', str(out)]) == 130
    printed, err = capsys.readouterr()
    assert 'Theorem 2 product bound' in printed and 'Traceback' not in err
    assert err.splitlines() == [f'python -m lipsformer.lipschitz: interrupted by Ctrl-C during the empirical '
                                f'estimates: the bounds are printed above and in --json {str(out)!r} (complete false)']
    saved = json.loads(out.read_text())
    assert saved['complete'] is False and isinstance(saved['product_bound'], float) and len(saved['branches']) == 20
    assert 'empirical_lipschitz' not in saved and saved['weights'] == 'at initialisation'
    monkeypatch.setattr('lipsformer.lipschitz.analysis.network_bound', interrupted)
    assert main([*_tiny_cli_args(attn_type='lipnorm'), '--json', str(tmp_path / 'other.json')]) == 130
    assert capsys.readouterr().err.splitlines() == [
        'python -m lipsformer.lipschitz: interrupted by Ctrl-C before the bounds were computed; nothing was written']
    assert not (tmp_path / 'other.json').exists()
    monkeypatch.undo()
    assert main([*_tiny_cli_args(attn_type='lipnorm'), '--json', str(out), '--iterations', '1', '--ascent-steps',
                 '0', '--branch-iterations', '1']) == 0
    assert json.loads(out.read_text())['complete'] is True



def test_cli_ctrl_c_while_the_bounds_are_written_names_the_file_that_holds_them(tmp_path, capsys, monkeypatch):
    """A Ctrl-C that lands while the bounds are written waits for the write, so that the last line names the file
    that holds them (a real SIGINT to this process, from inside the write)."""
    from lipsformer.lipschitz import report_command
    real_write_json = report_command.write_json

    def write_while_ctrl_c(path, data):
        os.kill(os.getpid(), signal.SIGINT)
        real_write_json(path, data)
    monkeypatch.setattr(report_command, 'write_json', write_while_ctrl_c)
    out = tmp_path / 'report.json'
    assert main([*_tiny_cli_args(attn_type='lipnorm'), '--json', str(out)]) == 130
    assert capsys.readouterr().err.splitlines()[-1] == (
        f'python -m lipsformer.lipschitz: interrupted by Ctrl-C during the empirical estimates: the bounds are printed '
        f'above and in --json {str(out)!r} (complete false)')
    assert json.loads(out.read_text())['complete'] is False

def test_module_entry_point_help():
    result = subprocess.run([sys.executable, '-m', 'lipsformer.lipschitz', '--help'], capture_output=True, text=True)
    assert result.returncode == 0 and '--checkpoint' in result.stdout and '--json' in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize('name', ['lipsformer_swin_tiny', 'lipsformer_cswin_tiny'])
@pytest.mark.parametrize('attn_type', ['scsa', 'lipnorm'])
def test_full_size_models_at_224(name, attn_type, tmp_path):
    """The command line on the real Tiny models at 224: bounds hold over every branch and the whole network."""
    out = tmp_path / 'report.json'
    assert main(['--model', name, '--json', str(out), '--model-kwargs', f'attn_type={attn_type}']) == 0
    report = json.loads(out.read_text())
    empirical = report['empirical_lipschitz']['gradient_ascent']
    assert 0 < report['empirical_lipschitz']['power_iteration'] <= empirical
    if attn_type != 'scsa':  # the authors' SCSA (v not normalised) has no bound
        assert empirical <= report['product_bound']
    for branch in report['branches']:
        if branch['lipschitz_bound'] != 'unbounded':
            assert 0 < branch['empirical'] <= branch['lipschitz_bound']
    print(f'{name} {attn_type}: product {report["product_bound"]}, empirical {empirical:.4g}, '
          f'{sum(report["seconds"].values()):.0f} s')
