"""Our models reproduce the authors' code: same logits from the same weights, and their checkpoint files load.

The fixtures in tests/fixtures/authors were produced by running the authors' model code (IDEA-Research/LipsFormer,
Swin at ad292d7, CSwin at 00acb80) outside this repository; tests/fixtures/authors/README.md says exactly how. Only
their outputs are committed: small models with the authors' own initialisation (state dict, input, logits), and for
full-size Swin-T and CSwin-T the authors' key names and shapes with the logits their code gave for the
deterministic weights of tests/synthetic_weights.py.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import timm
import torch
from synthetic_weights import synthetic_input, synthetic_state_dict
from tiny_models import TINY_SWIN

from lipsformer.models import lipsformer_cswin, lipsformer_swin
from lipsformer.weights.weight_files import CheckpointError, load_file, load_model_weights

AUTHORS = Path(__file__).parent / 'fixtures' / 'authors'
FAMILIES = {'swin': lipsformer_swin, 'cswin': lipsformer_cswin}


def _small_model(family: str, **overrides):
    kwargs = torch.load(AUTHORS / f'{family}_small.pt', weights_only=True)['kwargs']
    args = dict(img_size=kwargs['img_size'], num_classes=kwargs['num_classes'], embed_dim=kwargs['embed_dim'],
                num_heads=tuple(kwargs['num_heads']), depths=tuple(kwargs.get('depths', kwargs.get('depth'))))
    args.update(window_size=kwargs['window_size']) if family == 'swin' else args.update(
        split_size=tuple(kwargs['split_size']))
    args.update(overrides)
    return timm.create_model(f'lipsformer_{family}_tiny', **args).eval()


@pytest.mark.parametrize('family', FAMILIES)
def test_small_model_with_authors_init_gives_authors_logits(family):
    fixture = torch.load(AUTHORS / f'{family}_small.pt', weights_only=True)
    model = _small_model(family)
    model.load_state_dict(FAMILIES[family].checkpoint_filter_fn(fixture['state_dict'], model), strict=True)
    with torch.no_grad():
        logits = model(fixture['input'])
        pooled = model.forward_head(model.forward_features(fixture['input']), pre_logits=True)
    torch.testing.assert_close(logits, fixture['logits'], atol=1e-4, rtol=0)
    torch.testing.assert_close(pooled, fixture['features'], atol=1e-4, rtol=0)


@pytest.mark.parametrize('family', FAMILIES)
def test_full_size_tiny_gives_authors_logits(family):
    reference = json.loads((AUTHORS / f'{family}_tiny_synthetic.json').read_text())
    model = timm.create_model(f'lipsformer_{family}_tiny').eval()
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(reference['num_params'], rel=5e-3)
    state_dict = FAMILIES[family].checkpoint_filter_fn(synthetic_state_dict(reference['shapes']), model)
    model.load_state_dict(state_dict, strict=True)
    with torch.no_grad():
        logits = model(synthetic_input(2, 224))
    expected = torch.tensor(reference['logits'])
    assert expected.std() > 0.1  # the reference is not degenerate
    torch.testing.assert_close(logits, expected, atol=1e-4, rtol=0)


def _authors_file_kwargs():
    kwargs = torch.load(AUTHORS / 'swin_small.pt', weights_only=True)['kwargs']
    return dict(img_size=64, num_classes=10, embed_dim=kwargs['embed_dim'], depths=tuple(kwargs['depths']),
                num_heads=tuple(kwargs['num_heads']), window_size=kwargs['window_size'])


def test_authors_checkpoint_file_loads_through_timm_pretrained():
    """The released file layout ({'model', 'optimizer', ..., 'config': yacs CfgNode}) loads without unpickling code."""
    path = AUTHORS / 'authors_checkpoint_swin_small.pth'
    # Torch's weights-only loader alone refuses the pickled config; importing lipsformer admits it as plain data.
    plain_load = subprocess.run(
        [sys.executable, '-c', f'import torch; torch.load({str(path)!r}, weights_only=True)'],
        capture_output=True, text=True)
    assert plain_load.returncode != 0 and 'yacs.config.CfgNode' in plain_load.stderr
    raw = load_file(path)
    assert raw['config']['MODEL']['SWIN']['DEPTHS'] == [1, 1, 2, 1]
    fixture = torch.load(AUTHORS / 'swin_small.pt', weights_only=True)
    model = timm.create_model(
        'lipsformer_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10),
        **_authors_file_kwargs()).eval()
    with torch.no_grad():
        torch.testing.assert_close(model(fixture['input']), fixture['logits'], atol=1e-4, rtol=0)
    # timm's usual adaptation still applies: a new head and a single input channel.
    model = timm.create_model(
        'lipsformer_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path), num_classes=10),
        **dict(_authors_file_kwargs(), num_classes=5, in_chans=1))
    assert model.get_classifier().out_features == 5 and model.patch_embed.proj.in_channels == 1


def test_authors_checkpoint_with_other_depths_fails_naming_the_mismatch():
    path = AUTHORS / 'authors_checkpoint_swin_small.pth'
    kwargs = dict(_authors_file_kwargs(), depths=(1, 1, 3, 1))
    with pytest.raises(CheckpointError, match=r'checkpoint has depths \(1, 1, 2, 1\) but the model has depths '
                                              r'\(1, 1, 3, 1\)'):
        timm.create_model('lipsformer_swin_tiny', pretrained=True,
                          pretrained_cfg_overlay=dict(file=str(path), num_classes=10), **kwargs)


def test_checkpoint_of_the_other_family_or_class_count_is_rejected(tmp_path):
    swin = _small_model('swin')
    cswin_fixture = torch.load(AUTHORS / 'cswin_small.pt', weights_only=True)
    path = tmp_path / 'cswin.pth'
    torch.save({'model': cswin_fixture['state_dict']}, path)
    with pytest.raises(CheckpointError, match='does not fit LipsFormerSwin'):
        load_model_weights(swin, path)
    torch.save({'model': torch.load(AUTHORS / 'swin_small.pt', weights_only=True)['state_dict']}, path)
    with pytest.raises(CheckpointError, match=r'head\.fc\.weight: checkpoint \(10, 96\) vs model \(7, 96\)'):
        load_model_weights(_small_model('swin', num_classes=7), path)
    load_model_weights(swin, path)  # the right one loads


def test_malicious_pickle_is_refused_without_running_it(tmp_path):
    marker = tmp_path / 'pwned'

    class Exploit:
        def __reduce__(self):
            return os.system, (f'touch {marker}',)

    path = tmp_path / 'evil.pth'
    torch.save({'model': {'w': torch.ones(1)}, 'payload': Exploit()}, path)
    with pytest.raises(CheckpointError, match=r'refusing to load .*posix\.system|refusing to load .*system'):
        load_file(path)
    with pytest.raises(Exception):
        timm.create_model('lipsformer_swin_tiny', pretrained=True, pretrained_cfg_overlay=dict(file=str(path)),
                          **TINY_SWIN)
    assert not marker.exists()


def test_unreadable_files_give_clear_errors(tmp_path):
    with pytest.raises(CheckpointError, match='does not exist'):
        load_file(tmp_path / 'missing.pth')
    garbage = tmp_path / 'garbage.pth'
    garbage.write_bytes(b'not a checkpoint')
    with pytest.raises(CheckpointError, match='is not a checkpoint lipsformer can read: it is a text file'):
        load_file(garbage)


def test_bias_tables_are_resized_for_another_window():
    """Fine-tuning at another window size (as 224 -> 384 with window 7 -> 12) interpolates the bias tables."""
    fixture = torch.load(AUTHORS / 'swin_small.pt', weights_only=True)
    model = _small_model('swin', window_size=3)
    state_dict = lipsformer_swin.checkpoint_filter_fn(fixture['state_dict'], model)
    assert state_dict['stages.0.blocks.0.attn.relative_position_bias_table'].shape == (25, 1)
    model.load_state_dict(state_dict, strict=True)
    same_window = _small_model('swin')
    same_window.load_state_dict(lipsformer_swin.checkpoint_filter_fn(fixture['state_dict'], same_window))
    torch.testing.assert_close(  # the 2x2 last stage keeps its table untouched
        model.stages[3].blocks[0].attn.relative_position_bias_table,
        same_window.stages[3].blocks[0].attn.relative_position_bias_table)
    assert torch.isfinite(model(fixture['input'])).all()
