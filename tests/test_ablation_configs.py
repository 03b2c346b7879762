"""configs/ablations: one training recipe per row of the paper's Table 3, each loading with the training config
loader, building its model, and differing from the shared recipe only in its row's component."""
import dataclasses
import os
import re

import pytest
import timm
import torch

import lipsformer  # noqa: F401  (registers the models)
from lipsformer.training import config_to_dict, load_config

ABLATIONS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'ablations')

# LipsFormer Table 3 (LipsFormer-CSwin-T, 100 epochs, no warmup, top-1): file -> (the one setting that differs from
# _base.yaml, the paper's result).
TABLE_3 = {
    'warmup_none': ({'scheduler.warmup_epochs': 0}, '81.6'),
    'warmup_5_epochs': ({'scheduler.warmup_epochs': 5}, '81.2'),
    'norm_layernorm': ({'model.kwargs.norm_layer': 'layer'}, 'does not converge'),
    'norm_none': ({'model.kwargs.norm_layer': 'none'}, '80.3'),
    'norm_centernorm': ({'model.kwargs.norm_layer': 'center'}, '81.6'),
    'init_trunc_normal': ({'model.kwargs.weight_init': 'trunc_normal'}, 'slightly lower'),
    'init_xavier': ({'model.kwargs.weight_init': 'xavier'}, '81.6'),
    'init_spectral': ({'model.kwargs.weight_init': 'spectral'}, '81.6'),
    'attention_dot_product': ({'model.kwargs.attn_type': 'dot'}, 'diverged'),
    'attention_l2': ({'model.kwargs.attn_type': 'l2'}, '81.3'),
    'attention_scsa': ({'model.kwargs.attn_type': 'scsa'}, '81.6'),
    'alpha_0.1': ({'model.kwargs.alpha_init': 0.1}, '81.4'),
    'alpha_0.2': ({'model.kwargs.alpha_init': 0.2}, '81.6'),
    'alpha_0.3': ({'model.kwargs.alpha_init': 0.3}, '81.3'),
    'alpha_0.4': ({'model.kwargs.alpha_init': 0.4}, 'diverged'),
    'conv_a_none': ({'model.kwargs.conv_config': 'A'}, '80.7'),
    'conv_b_dw': ({'model.kwargs.conv_config': 'B'}, '81.2'),
    'conv_c_dw_pw': ({'model.kwargs.conv_config': 'C'}, '81.6'),
    'conv_d_dw_pw_dw': ({'model.kwargs.conv_config': 'D'}, '81.6'),
    'drop_path_0.0': ({'model.drop_path_rate': 0.0}, '81.3'),
    'drop_path_0.1': ({'model.drop_path_rate': 0.1}, '81.6'),
    'drop_path_0.2': ({'model.drop_path_rate': 0.2}, '81.6'),
}


def _flatten(data, prefix=''):
    flat = {}
    for key, value in data.items():
        if isinstance(value, dict) and value:
            flat.update(_flatten(value, f'{prefix}{key}.'))
        else:
            flat[f'{prefix}{key}'] = value
    return flat


def test_the_folder_holds_exactly_table_3():
    files = {name[:-5] for name in os.listdir(ABLATIONS) if name.endswith('.yaml')}
    assert files == set(TABLE_3) | {'_base'}


def test_the_shared_recipe_is_cswin_tiny_for_100_epochs_without_warmup():
    base = load_config(os.path.join(ABLATIONS, '_base.yaml'))
    assert base.model.name == 'lipsformer_cswin_tiny' and base.train.epochs == 100
    assert base.scheduler.warmup_epochs == 0 and base.optimizer.name == 'adamw'
    assert base.model.kwargs == dict(norm_layer='center', weight_init='spectral', attn_type='scsa', tau=12.0,
                                     alpha_init=0.2, conv_config='D')
    paper_tiny = load_config(os.path.join(ABLATIONS, '..', 'lipsformer_cswin_tiny.yaml'))
    assert dataclasses.replace(base, train=paper_tiny.train, model=paper_tiny.model) == paper_tiny


@pytest.mark.parametrize('row', sorted(TABLE_3))
def test_each_row_changes_one_component_and_states_the_paper_result(row):
    change, result = TABLE_3[row]
    path = os.path.join(ABLATIONS, f'{row}.yaml')
    with open(path) as f:
        first_line = f.readline()
    assert re.match(r'# Paper \(Table 3, LipsFormer-CSwin-T, 100 epochs, no warmup\): ', first_line)
    assert result in first_line
    config = _flatten(config_to_dict(load_config(path)))
    base = _flatten(config_to_dict(load_config(os.path.join(ABLATIONS, '_base.yaml'))))
    differences = {key: value for key, value in config.items() if base.get(key) != value}
    assert differences == {k: v for k, v in change.items() if base.get(k) != v}
    assert all(config[key] == value for key, value in change.items())
    with torch.device('meta'):  # the recipe's model builds (no weights allocated)
        model = timm.create_model(config['model.name'], drop_path_rate=config['model.drop_path_rate'],
                                  **load_config(path).model.kwargs)
    assert sum(p.numel() for p in model.parameters()) > 2e7
