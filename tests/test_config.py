"""Training configs: the shipped recipes match the paper and the authors' code, overrides parse as YAML, and every
kind of mistake fails before training with a message naming the key, the value and what is allowed."""
import glob
import os
import subprocess
import sys

import pytest
import timm

import lipsformer  # noqa: F401  (registers the models)
from lipsformer.training import ConfigError, load_config, reference_yaml
from lipsformer.training.config import check_config
from lipsformer.training.config_io import (
    PACKAGED_CONFIGS,
    config_from_dict,
    config_to_yaml,
    parse_override,
    resolve_config_path,
)
from lipsformer.training.session import check_config_callables

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIGS = os.path.join(REPO, 'configs')


def _config(name: str, *overrides: str):
    return load_config(os.path.join(CONFIGS, name), overrides)


def test_reference_config_is_current_and_documents_every_key():
    with open(os.path.join(CONFIGS, 'reference.yaml')) as f:
        shipped = f.read()
    assert shipped.strip() == reference_yaml().strip(), 'regenerate: python train.py --print-reference'
    assert load_config(os.path.join(CONFIGS, 'reference.yaml')) == load_config(None)


def test_every_registered_model_has_a_paper_config_and_all_configs_load():
    names = timm.list_models('lipsformer*')
    assert len(names) == 11
    for name in names:
        assert _config(f'{name}.yaml').model.name == name
    for path in glob.glob(os.path.join(CONFIGS, '*.yaml')) + glob.glob(os.path.join(CONFIGS, 'authors', '*.yaml')):
        config = load_config(path)
        assert timm.is_model(config.model.name), path


@pytest.mark.parametrize('name, drop_path, lr, weight_decay, ema_decay, betas', [
    ('lipsformer_swin_tiny', 0.2, 2e-3, 0.05, 0.99984, [0.9, 0.999]),
    ('lipsformer_cswin_small', 0.4, 2e-3, 0.05, 0.99984, [0.9, 0.999]),
    ('lipsformer_swin_base', 0.5, 1e-3, 0.1, 0.99992, [0.9, 0.999]),
    ('lipsformer_swin_large', 0.5, 1e-3, 0.1, 0.99992, [0.9, 0.99]),
])
def test_paper_recipe_table6(name, drop_path, lr, weight_decay, ema_decay, betas):
    config = _config(f'{name}.yaml')
    assert config.scheduler.warmup_epochs == 0 and config.scheduler.name == 'cosine'
    assert config.optimizer.name == 'adamw' and config.optimizer.eps == 1e-8 and config.optimizer.betas == betas
    assert (config.optimizer.lr, config.optimizer.lr_base_batch_size) == (lr, 2048)
    assert config.optimizer.weight_decay == weight_decay and config.optimizer.no_decay_weight_decay == 0
    assert config.optimizer.clip_grad is None
    assert config.model.drop_path_rate == drop_path
    assert config.ema.enabled and config.ema.decay == ema_decay and config.ema.reference_batch_size == 2048
    augment = config.augment
    assert augment.label_smoothing == 0.1 and augment.auto_augment.startswith('rand-m9-mstd0.5')
    assert (augment.mixup, augment.cutmix, augment.reprob) == (0.8, 1.0, 0.25)
    assert config.train.epochs == 300


def test_authors_recipe_where_it_differs():
    tiny = _config('authors/lipsformer_swin_tiny.yaml')
    assert (tiny.optimizer.lr, tiny.optimizer.lr_base_batch_size, tiny.optimizer.betas) == (5e-4, 512, [0.9, 0.98])
    assert tiny.optimizer.no_decay_weight_decay == 5e-4 and tiny.optimizer.clip_grad == 5.0
    assert tiny.scheduler.min_lr == 5e-6 and tiny.scheduler.warmup_epochs == 0
    assert not tiny.ema.enabled and tiny.train.mixed_precision == 'fp16'
    base = _config('authors/lipsformer_swin_base.yaml')
    assert (base.optimizer.lr, base.optimizer.betas) == (2.5e-4, [0.9, 0.998])
    assert _config('authors/lipsformer_swin_small.yaml').model.drop_path_rate == 0.3


def test_overrides_are_parsed_as_yaml_and_nest():
    config = _config('lipsformer_swin_tiny.yaml', 'optimizer.lr=1e-3', 'optimizer.betas=[0.9, 0.95]',
                     'model.kwargs.depths=[1, 1, 2, 1]', 'train.mixed_precision=no', 'ema.enabled=false',
                     'augment.auto_augment=null')
    assert config.optimizer.lr == 1e-3 and isinstance(config.optimizer.lr, float)
    assert config.optimizer.betas == [0.9, 0.95]
    assert config.model.kwargs == {'depths': [1, 1, 2, 1]}
    assert config.train.mixed_precision == 'no'  # YAML reads `no` as false; the key takes the literal back
    assert not config.ema.enabled and config.augment.auto_augment is None
    assert parse_override('data.data_dir=/a=b') == ('data.data_dir', '/a=b')


def test_base_files_merge_and_cycles_fail(tmp_path):
    (tmp_path / 'parent.yaml').write_text('optimizer: {lr: 1.0e-3, weight_decay: 0.2}\nmodel: {kwargs: {a: 1}}\n')
    (tmp_path / 'child.yaml').write_text('base: parent.yaml\noptimizer: {lr: 5.0e-4}\nmodel: {kwargs: {b: 2}}\n')
    config = load_config(tmp_path / 'child.yaml')
    assert (config.optimizer.lr, config.optimizer.weight_decay) == (5e-4, 0.2)
    assert config.model.kwargs == {'a': 1, 'b': 2}
    (tmp_path / 'loop.yaml').write_text('base: loop.yaml\n')
    with pytest.raises(ConfigError, match='includes itself'):
        load_config(tmp_path / 'loop.yaml')


def test_base_takes_a_packaged_name_and_replace_drops_the_base_s_keys(tmp_path):
    """base: took only paths relative to the file, and mappings always merged, so a config switching from Swin to
    CSwin kept the base's window_size in model.kwargs."""
    (tmp_path / 'quick_cswin.yaml').write_text(
        'base: quickstart\nmodel:\n  name: lipsformer_cswin_tiny\n'
        '  kwargs: !replace {embed_dim: 32, depths: [1, 1, 1, 1], num_heads: [2, 2, 4, 8], split_size: [1, 2, 2, 1]}\n'
        'train: {epochs: 1}\n')
    config = load_config(tmp_path / 'quick_cswin.yaml')
    quickstart = load_config('quickstart')
    assert config.model.kwargs == {'embed_dim': 32, 'depths': [1, 1, 1, 1], 'num_heads': [2, 2, 4, 8],
                                   'split_size': [1, 2, 2, 1]}
    assert (config.model.name, config.model.img_size, config.train.epochs) == ('lipsformer_cswin_tiny', 32, 1)
    assert config.data == quickstart.data and config.optimizer == quickstart.optimizer
    timm.create_model(config.model.name, img_size=32, in_chans=1, **config.model.kwargs)  # no stray window_size
    assert type(config.model.kwargs) is dict and 'window_size' not in config_to_yaml(config)
    (tmp_path / 'grandchild.yaml').write_text('base: quick_cswin.yaml\nmodel: {kwargs: {mlp_ratio: 2.0}}\n')
    assert load_config(tmp_path / 'grandchild.yaml').model.kwargs == {**config.model.kwargs, 'mlp_ratio': 2.0}
    (tmp_path / 'section.yaml').write_text('base: quickstart\naugment: !replace {hflip: 0.0}\n')
    assert load_config(tmp_path / 'section.yaml').augment == load_config(None, ['augment.hflip=0.0']).augment
    assert load_config(None, ['model.kwargs=!replace {a: 1}']).model.kwargs == {'a': 1}  # overrides replace anyway


def test_a_derived_config_switching_families_builds_a_cswin_without_the_swin_s_window_size(tmp_path):
    """Built as a run builds it: merged, the base's window_size reached LipsFormer-CSwin and the run stopped."""
    from lipsformer.models.lipsformer_cswin import CrossStripeAttention, LipsFormerCSwin
    from lipsformer.training.data import resolve_input_spec
    from lipsformer.training.session import create_run_model
    cswin = 'model:\n  name: lipsformer_cswin_tiny\n  kwargs: {tag}{{embed_dim: 32, depths: [1, 1, 1, 1], ' \
            'num_heads: [2, 2, 4, 8], split_size: [1, 2, 2, 1]}}\n'
    (tmp_path / 'merged.yaml').write_text('base: quickstart\n' + cswin.format(tag=''))
    merged = load_config(tmp_path / 'merged.yaml')
    with pytest.raises(ConfigError, match=r"model.kwargs: lipsformer_cswin_tiny does not accept \['window_size'\]"):
        create_run_model(merged, 10, resolve_input_spec(merged))
    (tmp_path / 'replaced.yaml').write_text('base: quickstart\n' + cswin.format(tag='!replace '))
    replaced = load_config(tmp_path / 'replaced.yaml')
    model, kwargs = create_run_model(replaced, 10, resolve_input_spec(replaced))
    assert type(model) is LipsFormerCSwin and 'window_size' not in kwargs
    assert [stage.blocks[0].attn.split_size for stage in model.stages] == [1, 2, 2, 1]
    assert all(isinstance(stage.blocks[0].attn, CrossStripeAttention) for stage in model.stages)
    assert (kwargs['img_size'], kwargs['in_chans'], kwargs['embed_dim']) == (32, 1, 32)  # the rest from quickstart


@pytest.mark.parametrize('name', ['quickstart', 'quickstart.yaml', 'ablations/alpha_0.1', 'PACKAGED'])
def test_base_takes_every_name_config_takes_resolved_by_one_function(tmp_path, name):
    """A packaged name, with or without .yaml, in a folder, or a path: base: and --config resolve it alike."""
    if name == 'PACKAGED':
        name = os.path.join(PACKAGED_CONFIGS, 'lipsformer_swin_tiny.yaml')
    (tmp_path / 'child.yaml').write_text(f'base: {name}\n')
    assert resolve_config_path(name, relative_to=tmp_path / 'child.yaml') == resolve_config_path(name)
    assert load_config(tmp_path / 'child.yaml') == load_config(name)


def test_a_base_file_beside_the_config_wins_over_a_packaged_name(tmp_path):
    (tmp_path / 'quickstart.yaml').write_text('train: {epochs: 7}\n')
    (tmp_path / 'child.yaml').write_text('base: quickstart.yaml\n')
    assert resolve_config_path('quickstart.yaml', relative_to=tmp_path / 'child.yaml') == str(
        tmp_path / 'quickstart.yaml')
    assert load_config(tmp_path / 'child.yaml').train.epochs == 7


@pytest.mark.parametrize('text, message', [
    ('base: quickstrat\n', r"child.yaml': base: 'quickstrat': cannot read config file .*quickstrat': no such file, "
                            r"nor a packaged config \(did you mean quickstart\?\)"),
    ('base: 3\n', r'base must name another YAML file .a path relative to this file, or a packaged config'),
    ('base: quickstart\nmodel: {img_size: !replace 64}\n', r'!replace marks a mapping'),
    ('model: {kwargs: !replace {depth: 2}}\n', r"marks model.kwargs !replace, which replaces a mapping of the base "
                                                r"config, but has no base:"),
])
def test_base_and_replace_mistakes_are_said(tmp_path, text, message):
    (tmp_path / 'child.yaml').write_text(text)
    with pytest.raises(ConfigError, match=message):
        load_config(tmp_path / 'child.yaml')


@pytest.mark.parametrize('override, message', [
    ('optimizer.lrr=1e-3', r"unknown config key 'optimizer.lrr' \(did you mean 'optimizer.lr'\?\)"),
    ('optimiser.lr=1e-3', r"unknown config key 'optimiser' \(did you mean 'optimizer'\?\)"),
    ('optimizer.lr=fast', r"optimizer.lr: got 'fast' \(str\); expected a number"),
    ('optimizer.lr=-1', r'optimizer.lr: got -1.0; allowed: a number > 0'),
    ('train.batch_size=12.5', r'train.batch_size: got 12.5 \(float\); expected an integer'),
    ('train.batch_size=true', r'train.batch_size: got True \(bool\); expected an integer'),
    ('train.mixed_precision=fp8', r"train.mixed_precision: got 'fp8'.*'no', 'fp16', 'bf16'"),
    ('augment.mixup_prob=1.5', r'augment.mixup_prob: got 1.5; allowed: a probability in \[0, 1\]'),
    ('optimizer.betas=[0.9]', r'optimizer.betas: got \[0.9\]; allowed: two numbers in \[0, 1\)'),
    ('ema.decay=1.0', r'ema.decay: got 1.0; allowed: a number in \[0, 1\)'),
    ('model.drop_path_rate=1', r'model.drop_path_rate: got 1.0; allowed: a number in \[0, 1\)'),
    ('scheduler.name=linear', r"scheduler.name: got 'linear'; allowed: cosine, tanh"),
    ('model.img_size=100', r'model.img_size: got 100; LipsFormer models need a multiple of 32 \(e.g. 96\)'),
    ('train.batch_size=7', r'train.batch_size: got 7; mixup/CutMix in .batch. mode needs an even batch'),
    ('data.mean=[0.5]', r'data.mean: got \[0.5\], 1 values for model.in_chans=3'),
    ('data.dataset=wds/imagenet', r'data.train_num_samples: got null; the iterable dataset'),
    ('model.kwargs=3', r'model.kwargs: got 3; expected a mapping'),
    ('checkpoint.best_metric=top1', r"checkpoint.best_metric: got 'top1'; allowed values: 'auto'"),
    ('justakey', r'not of the form key.sub=value'),
    ('checkpoint.best_metric=ema_val_top1 ema.enabled=false', r'no EMA to rank checkpoints by'),
])
def test_mistakes_name_key_value_and_what_is_allowed(override, message):
    with pytest.raises(ConfigError, match=message):
        _config('lipsformer_swin_tiny.yaml', *override.split(' '))


@pytest.mark.parametrize('override, message', [
    ('optimizer.lr=.inf', r'optimizer.lr: got inf; expected a finite number'),
    ('optimizer.lr=inf', r"optimizer.lr: got 'inf'; expected a finite number"),
    ('optimizer.lr=1e400', r"optimizer.lr: got '1e400'; expected a finite number"),
    ('optimizer.weight_decay=.inf', r'optimizer.weight_decay: got inf; expected a finite number'),
    ('scheduler.min_lr=-.inf', r'scheduler.min_lr: got -inf; expected a finite number'),
    ('scheduler.warmup_epochs=.nan', r'scheduler.warmup_epochs: got nan; expected a finite number'),
    ('optimizer.clip_grad=.inf', r'optimizer.clip_grad: got inf; expected a finite number'),
    ('augment.scale=[0.5,.inf]', r'augment.scale\[1\]: got inf; expected a finite number'),
    ('data.std=[.inf,1,1]', r'data.std\[0\]: got inf; expected a finite number'),
    ('model.kwargs={alpha_init: .inf}', r'model.kwargs.alpha_init: got inf; expected a finite number'),
    ('lipschitz.kwargs={caps: {attn: [1.0, .nan]}}', r'lipschitz.kwargs.caps.attn\[1\]: got nan; expected a finite'),
])
def test_every_float_must_be_finite(override, message):
    """An infinite learning rate used to pass the rule lr > 0 (NaN and 0 did not) and made every update
    non-finite."""
    with pytest.raises(ConfigError, match=message):
        _config('lipsformer_swin_tiny.yaml', override)


def test_a_number_that_is_not_finite_is_refused_with_what_the_key_allows():
    with pytest.raises(ConfigError, match=r'^optimizer.lr: got inf; expected a finite number \(allowed: a number > 0\)'
                                          r': .inf, .nan and numbers beyond 1.8e308 are not$'):
        load_config(None, ['optimizer.lr=.inf'])
    with pytest.raises(ConfigError, match=r'model.kwargs \(a key\): got inf; expected a finite number'):
        load_config(None, ['model.kwargs={.inf: 1}'])


@pytest.mark.parametrize('section, key, value, message', [
    ('optimizer', 'lr', float('inf'), r'optimizer.lr: got inf; expected a finite number \(allowed: a number > 0\)'),
    ('scheduler', 'min_lr', float('-inf'), r'scheduler.min_lr: got -inf; expected a finite number'),
    ('ema', 'decay', float('nan'), r'ema.decay: got nan; expected a finite number'),
    ('optimizer', 'clip_grad', float('inf'), r'optimizer.clip_grad: got inf; expected a finite number'),
    ('augment', 'ratio', [0.75, float('inf')], r'augment.ratio\[1\]: got inf; expected a finite number'),
    ('model', 'kwargs', {'mlp_ratio': [4.0, float('nan')]}, r'model.kwargs.mlp_ratio\[1\]: got nan'),
])
def test_a_config_made_in_python_is_checked_for_finite_numbers_too(section, key, value, message):
    """check_config passed an infinite lr set in Python (inf > 0): only the YAML reader looked for it."""
    config = load_config(None)
    setattr(getattr(config, section), key, value)
    with pytest.raises(ConfigError, match=message):
        check_config(config)


def test_train_refuses_a_config_changed_in_python_to_an_infinite_lr_before_it_writes_anything(tmp_path):
    """train() takes Config objects as well as files: an infinite lr set in Python must not start a run."""
    from lipsformer.training import train
    config = load_config(None)
    config.optimizer.lr = float('inf')
    with pytest.raises(ConfigError, match='optimizer.lr: got inf'):
        train(config, str(tmp_path / 'run'))
    assert not (tmp_path / 'run').exists()


def test_broken_files_are_reported(tmp_path):
    (tmp_path / 'bad.yaml').write_text('optimizer: {lr: [1, 2\n')
    with pytest.raises(ConfigError, match='is not valid YAML'):
        load_config(tmp_path / 'bad.yaml')
    with pytest.raises(ConfigError, match='cannot read config file'):
        load_config(tmp_path / 'missing.yaml')
    with pytest.raises(ConfigError, match='expected a mapping of keys'):
        config_from_dict({'optimizer': 3})


def test_a_key_given_twice_is_an_error(tmp_path):
    """Plain YAML keeps the second `lr` and drops the first without a word; the user meant one of them."""
    (tmp_path / 'twice.yaml').write_text('optimizer:\n  lr: 1.0e-3\n  weight_decay: 0.05\n  lr: 2.0e-3\n')
    with pytest.raises(ConfigError, match="found the key 'lr' twice .first on line 2.; YAML would keep the last"):
        load_config(tmp_path / 'twice.yaml')
    (tmp_path / 'sections.yaml').write_text('train: {epochs: 3}\nmodel: {name: resnet18}\ntrain: {batch_size: 4}\n')
    with pytest.raises(ConfigError, match="found the key 'train' twice"):
        load_config(tmp_path / 'sections.yaml')
    with pytest.raises(ConfigError, match="found the key 'a' twice"):
        load_config(None, ['model.kwargs={a: 1, a: 2}'])
    (tmp_path / 'anchors.yaml').write_text('model:\n  kwargs: &k {depth: 2}\n  name: test_vit\n'
                                           'lipschitz:\n  kwargs: {<<: *k, depth: 3}\n')
    assert load_config(tmp_path / 'anchors.yaml').lipschitz.kwargs == {'depth': 3}  # a merge key may be overridden


def test_cli_reports_config_errors_before_training(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO, 'train.py'), '--config',
                             os.path.join(CONFIGS, 'quickstart.yaml'), '--output', str(tmp_path / 'run'),
                             'optimizer.lr=0'], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert 'optimizer.lr: got 0.0; allowed: a number > 0' in result.stderr
    assert not (tmp_path / 'run').exists()


def test_cli_prints_the_resolved_config_that_loads_back(tmp_path):
    result = subprocess.run([sys.executable, os.path.join(REPO, 'train.py'), '--config',
                             os.path.join(CONFIGS, 'quickstart.yaml'), '--print-config', 'optimizer.lr=1e-3'],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    (tmp_path / 'printed.yaml').write_text(result.stdout)
    assert load_config(tmp_path / 'printed.yaml') == _config('quickstart.yaml', 'optimizer.lr=1e-3')


def test_a_config_runs_no_code_it_names_unless_the_user_trusts_it_by_name(data_dir, tmp_path, caplog):
    """`lipschitz.target: timeit:timeit` with `kwargs.setup` would execute the setup string (a config someone else
    wrote, `--config runs/x/config.yaml`): refused before anything runs, the run folder never made, unless
    --trust-callable names it. The package's own constraint needs no trust."""
    from training_support import tiny_overrides

    from lipsformer.training.train_command import main
    marker = tmp_path / 'code-ran'
    config = tmp_path / 'config.yaml'
    config.write_text(f'lipschitz:\n  enabled: true\n  target: timeit:timeit\n'
                      f'  kwargs: {{setup: "open({str(marker)!r}, \'w\').close()", number: 1}}\n')
    args = ['--config', str(config), *tiny_overrides(data_dir, **{'train.epochs': 1, 'checkpoint.export': False})]
    assert main([*args, '--output', str(tmp_path / 'run')]) == 2
    assert not marker.exists() and not (tmp_path / 'run').exists()
    reason = caplog.records[-1].getMessage()
    assert "lipschitz.target: 'timeit:timeit' is not one of the package's callables" in reason
    assert 'train.py --trust-callable timeit:timeit' in reason
    # trusted by name, it is imported and called (its setup runs; its statement, the model, fails without input)
    assert main([*args, '--output', str(tmp_path / 'trusted'), '--trust-callable', 'timeit:timeit']) == 2
    assert marker.exists()
    with pytest.raises(ConfigError, match="'probe_models:AlphaCap' is not one of the package's callables"):
        check_config_callables(load_config(None, ['lipschitz.enabled=true',
                                                  'lipschitz.target=probe_models:AlphaCap']))
    check_config_callables(load_config(None, ['lipschitz.enabled=true']))  # the default, the package's own
    check_config_callables(load_config(None, ['lipschitz.target=timeit:timeit']))  # not enabled: never imported
