"""timm's checkpoints, flags and conventions in this package's commands.

- a checkpoint as timm's ``train.py`` saves it (its own ``CheckpointSaver``: ``args`` as an ``argparse.Namespace``,
  ``state_dict``, ``state_dict_ema``, ``arch``, ``epoch``, ``version``) is scored by validate.py exactly as timm's
  preprocessing of those arguments scores it, converted, and loaded by ``load_model_weights``;
- timm's documented command lines (hfdocs ``training_script.mdx`` and the release notes' ``--model-kwargs`` /
  ``--input-size`` lines) replayed on a tiny data set with this package's models;
- ``resolve_model_data_config`` of a model built for another input size, usage lines and help texts.
"""
import argparse
import json
import os
import sys

import pytest
import timm
import torch
from timm.data import create_dataset, create_transform, resolve_data_config
from timm.optim import create_optimizer_v2
from timm.utils import CheckpointSaver, ModelEmaV3
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN_KWARGS, TINY_MODELS

from lipsformer.evaluation.validate_command import main as validate_main
from lipsformer.hub.convert import main as convert_main
from lipsformer.training.train_command import main as train_main
from lipsformer.weights.model_folder import save_model_folder
from lipsformer.weights.weight_files import CheckpointError, load_file, load_model_weights

pytestmark = pytest.mark.usefixtures('one_thread')

# timm train.py's command line for the checkpoint below (with its defaults for every other flag that matters here):
#   train.py --data-dir DATA --model lipsformer_swin_tiny --device-modules lipsformer --device cpu --model-kwargs
#   embed_dim=16 depths=1,1,1,1 num_heads=1,1,1,1 window_size=4 --img-size 32 --in-chans 1 --num-classes 4
#   --mean 0.5 --std 0.5 --opt adamw --model-ema --model-ema-decay 0.9 -b 8
TIMM_ARGS = dict(
    data=None, dataset='', train_split='train', val_split='validation', model=SMALLEST_MODEL, pretrained=False,
    pretrained_path=None, initial_checkpoint='', resume='', num_classes=4, gp=None, img_size=32, in_chans=1,
    input_size=None, crop_pct=None, mean=[0.5], std=[0.5], interpolation='', batch_size=8, validation_batch_size=None,
    channels_last=False, grad_accum_steps=1, grad_checkpointing=False,
    model_kwargs={k: tuple(v) if isinstance(v, list) else v for k, v in SMALLEST_SWIN_KWARGS.items()},
    device='cpu', device_modules=['lipsformer'], amp=False, amp_dtype='float16', model_dtype=None, opt='adamw',
    opt_eps=None, opt_betas=None, momentum=0.9, weight_decay=2e-5, clip_grad=None, clip_mode='norm', layer_decay=None,
    opt_kwargs={}, sched='cosine', lr=None, lr_base=0.1, lr_base_size=256, epochs=2, decay_milestones=[90, 180, 270],
    warmup_epochs=5, scale=[0.08, 1.0], ratio=[3. / 4., 4. / 3.], hflip=0.5, aa=None, reprob=0.0, mixup=0.0,
    cutmix=0.0, smoothing=0.1, drop=0.0, drop_path=None, model_ema=True, model_ema_decay=0.9, seed=42,
    workers=0, output='', experiment='', eval_metric='top1', prefetcher=False, distributed=False, world_size=1,
    rank=0, local_rank=0)


@pytest.fixture(scope='module')
def timm_checkpoint(tmp_path_factory):
    """``model_best.pth.tar`` as timm's CheckpointSaver writes it, and the raw and EMA models in it."""
    args = argparse.Namespace(**TIMM_ARGS)
    # train.py's create_model call (the model at its default size; the data at --img-size)
    model = timm.create_model(args.model, num_classes=args.num_classes, in_chans=args.in_chans, global_pool=args.gp,
                              drop_rate=args.drop, **args.model_kwargs)
    ema = ModelEmaV3(model, decay=args.model_ema_decay)
    optimizer = create_optimizer_v2(model, args.opt, lr=1e-3, weight_decay=args.weight_decay)
    for _ in range(3):  # a few updates, so that the raw and EMA weights differ
        model(torch.randn(4, 1, 32, 32)).logsumexp(-1).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(model)
    folder = tmp_path_factory.mktemp('timm_output')
    saver = CheckpointSaver(model, optimizer, args=args, model_ema=ema, checkpoint_dir=str(folder),
                            recovery_dir=str(folder), decreasing=False, max_history=2)
    saver.save_checkpoint(epoch=1, metric=50.0)
    return str(folder / 'model_best.pth.tar'), model.eval(), ema.module.eval()


def _timm_top1(model: torch.nn.Module, data_dir: str) -> float:
    """Top-1 (%) on ``data_dir/validation`` with the preprocessing timm's validate.py derives from train.py's
    arguments (resolve_data_config of them, 'L' images for one channel)."""
    transform = create_transform(**resolve_data_config(TIMM_ARGS, model=model))
    dataset = create_dataset('', root=data_dir, split='validation', input_img_mode='L', transform=transform)
    with torch.no_grad():
        correct = sum(int(model(image.unsqueeze(0)).argmax() == target) for image, target in dataset)
    return 100 * correct / len(dataset)


def _validate(results, *argv: str) -> dict:
    assert validate_main([*argv, '--results-file', str(results), '--workers', '0']) == 0
    return json.loads(results.read_text())


def test_a_timm_train_checkpoint_in_every_command(timm_checkpoint, data_dir, tmp_path):
    path, model, ema = timm_checkpoint
    saved = torch.load(path, weights_only=False)  # the file really is timm's layout, with args as a Namespace
    assert isinstance(saved['args'], argparse.Namespace) and saved['arch'] == SMALLEST_MODEL
    assert {'state_dict', 'state_dict_ema', 'optimizer', 'epoch', 'version', 'metric'} <= set(saved)
    assert load_file(path)['args'].model_kwargs == saved['args'].model_kwargs  # read as data

    # validate.py builds the model from the saved arguments (no --model needed) and preprocesses as timm does.
    folder = os.path.join(data_dir, 'validation')
    raw = _validate(tmp_path / 'raw.json', '--checkpoint', path, '--data-dir', folder, '--data-layout',
                    'imagefolder')
    assert raw['model'] == SMALLEST_MODEL and raw['settings']['input_size'] == [1, 32, 32]
    assert raw['results'][0]['top1'] == pytest.approx(_timm_top1(model, data_dir))
    named = _validate(tmp_path / 'ema.json', '--checkpoint', path, '--use-ema', '--model', f'{SMALLEST_MODEL}',
                      '--data-dir', folder, '--data-layout', 'imagefolder')
    assert named['results'][0]['top1'] == pytest.approx(_timm_top1(ema, data_dir))

    # lipsformer.hub.convert: a timm model folder with the same logits, its architecture from the saved arguments.
    assert convert_main([path, str(tmp_path / 'converted'), '--use-ema']) == 0
    converted = timm.create_model(f'local-dir:{tmp_path / "converted"}', pretrained=True).eval()
    inputs = torch.randn(2, 1, 32, 32)
    with torch.no_grad():
        assert torch.equal(converted(inputs), ema(inputs))
    # load_model_weights, raw and EMA.
    fresh = timm.create_model(SMALLEST_MODEL, num_classes=4, in_chans=1, **TIMM_ARGS['model_kwargs']).eval()
    for weights, use_ema in ((model, False), (ema, True)):
        load_model_weights(fresh, path, use_ema=use_ema)
        with torch.no_grad():
            assert torch.equal(fresh(inputs), weights(inputs))


def test_a_namespace_holding_code_is_still_refused(timm_checkpoint, tmp_path):
    """Only the Namespace is admitted: a value in it that is code (here a class) keeps the file refused."""
    path, _, _ = timm_checkpoint
    checkpoint = torch.load(path, weights_only=False)
    checkpoint['args'].loss = torch.nn.CrossEntropyLoss
    torch.save(checkpoint, tmp_path / 'code.pth.tar')
    with pytest.raises(CheckpointError, match=r'references code \(torch.nn.modules.loss.CrossEntropyLoss\)'):
        load_file(tmp_path / 'code.pth.tar')


def test_timm_documented_command_lines(data_dir, tmp_path, capsys):
    """hfdocs training_script.mdx's train and validate lines, with this package's model and the flags timm users add
    (--model-kwargs, --input-size, --layer-decay, --gp, --device; --data-dir ROOT --split NAME, --pretrained,
    --in-chans, --num-classes for validate)."""
    output = tmp_path / 'output'
    train_argv = ['--data-dir', data_dir, '--model', SMALLEST_MODEL, '--sched', 'cosine', '--epochs', '1',
                  '--warmup-epochs', '0', '--lr', '0.001', '--reprob', '0.5', '--remode', 'pixel', '--batch-size', '8',
                  '-j', '0', '--opt', 'adamw', '--model-ema', '--model-ema-decay', '0.9', '--mean', '0.5', '--std',
                  '0.5', '--model-kwargs', 'embed_dim=16', 'depths=1,1,1,1', 'num_heads=1,1,1,1', 'window_size=4',
                  'log.plots=false', '--input-size', '1', '32', '32', '--num-classes', '4', '--gp', 'max',
                  '--layer-decay', '0.75', '--device', 'cpu', '--output', str(output), '--experiment', 'tiny',
                  'train.progress_bar=false', 'log.trackers=[]']
    assert train_main(train_argv) == 0
    run = output / 'tiny'
    config = json.load(open(run / 'export' / 'best' / 'config.json'))
    assert config['model_args'] == dict(embed_dim=16, depths=[1, 1, 1, 1], num_heads=[1, 1, 1, 1], window_size=4,
                                        global_pool='max', in_chans=1, img_size=[32, 32])
    assert config['num_classes'] == 4 and config['pretrained_cfg']['input_size'] == [1, 32, 32]
    # --layer-decay: timm's layer-wise groups (lr_scale per stage) in the optimizer the run saved.
    (checkpoint,) = [p for p in (run / 'checkpoints').iterdir() if p.is_dir()]
    groups = load_file(checkpoint / 'optimizer.pt')['param_groups']
    reference = create_optimizer_v2(timm.create_model(f'local-dir:{run / "export" / "best"}'), 'adamw', lr=1e-3,
                                    weight_decay=0.05, layer_decay=0.75).param_groups
    assert [(g['lr_scale'], len(g['params'])) for g in groups] == [(g['lr_scale'], len(g['params']))
                                                                   for g in reference]
    assert min(g['lr_scale'] for g in groups) == pytest.approx(0.75 ** 5)  # stem, four stages, head

    summary = json.load(open(run / 'summary.json'))
    (root_form, folder_form) = [
        _validate(tmp_path / f'{name}.json', *data, '--model', SMALLEST_MODEL, '--pretrained', '--checkpoint',
                  str(run), '--device', 'cpu', '--in-chans', '1', '--num-classes', '4', '--gp', 'max',
                  '--data-layout', 'imagefolder')
        for name, data in (('root', ['--data-dir', data_dir, '--split', 'validation']),
                           ('folder', [os.path.join(data_dir, 'validation')]))]  # timm's positional DIR
    (root_result,), (folder_result,) = root_form['results'], folder_form['results']
    assert {**root_result, 'images_per_s': 0} == {**folder_result, 'images_per_s': 0}
    assert root_form['settings']['device'] == 'cpu' and root_result['path'] == os.path.join(data_dir, 'validation')
    assert root_result['top1'] == pytest.approx(summary['final_metrics']['val_top1'])
    assert validate_main(['--data-dir', data_dir, '--split', 'test', '--checkpoint', str(run), '--data-layout',
                          'imagefolder']) == 2
    assert "--split: no split 'test' under" in capsys.readouterr().err


def test_train_flags_set_their_keys_and_refuse_contradictions(capsys, caplog):
    assert train_main(['--print-config', '--model-kwargs', 'depths=2,2,6,2', 'act_layer=gelu', 'train.epochs=3',
                       '--input-size', '1', '64', '64', '--gp', 'avg', '--layer-decay', '0.65', '--device', 'cpu']) == 0
    printed = capsys.readouterr().out
    for line in ('    depths: [2, 2, 6, 2]', '    act_layer: gelu', '    global_pool: avg', '  img_size: 64',
                 '  in_chans: 1', '  layer_decay: 0.65', 'epochs: 3', 'device: cpu'):
        assert line in printed, line
    assert train_main(['--print-config', '--input-size', '3', '64', '96']) == 2
    assert train_main(['--print-config', '--input-size', '3', '64', '64', '--in-chans', '1']) == 2
    assert train_main(['--print-config', '--layer-decay', '1.5']) == 2
    for reason in ('--input-size 3 64 96: model.img_size is square',
                   '--in-chans sets model.in_chans=1 but --input-size sets it to 3',
                   'optimizer.layer_decay: got 1.5; allowed: null or a number in (0, 1]'):
        assert reason in caplog.text


@pytest.mark.parametrize('name', list(TINY_MODELS))
def test_data_config_follows_the_size_the_model_was_built_for(name, tmp_path):
    model = timm.create_model(name, num_classes=3, in_chans=1, **TINY_MODELS[name])  # img_size=64
    assert timm.data.resolve_model_data_config(model)['input_size'] == (1, 64, 64)
    assert timm.data.resolve_input_data_config(model)['input_size'] == (1, 64, 64)
    save_model_folder(model, str(tmp_path / 'folder'))  # what an export of it says
    assert json.load(open(tmp_path / 'folder' / 'config.json'))['pretrained_cfg']['input_size'] == [1, 64, 64]
    model.set_input_size(96)
    assert timm.data.resolve_model_data_config(model)['input_size'] == (1, 96, 96)
    features = timm.create_model(name, features_only=True, **TINY_MODELS[name])
    assert timm.data.resolve_model_data_config(features)['input_size'] == (3, 64, 64)
    assert timm.data.resolve_model_data_config(timm.create_model(name, **dict(TINY_MODELS[name], img_size=224))
                                               )['input_size'] == (3, 224, 224)


# console script: (module holding its parser, the parser's builder, the module `python -m` runs)
COMMANDS = {
    'lipsformer-validate': ('lipsformer.evaluation.validate_command', 'build_validate_parser',
                            'lipsformer.evaluation.validate_command'),
    'lipsformer-lipschitz': ('lipsformer.lipschitz.report_command', 'build_lipschitz_parser', 'lipsformer.lipschitz'),
    'lipsformer-benchmark': ('lipsformer.instruments.benchmark', '_parser', 'lipsformer.instruments.benchmark'),
    'lipsformer-train': ('lipsformer.training.train_command', '_parser', 'lipsformer.training.train_command'),
}


@pytest.mark.parametrize('command', list(COMMANDS))
def test_usage_names_the_command_as_it_was_run(command, monkeypatch):
    module_name, builder, run_module = COMMANDS[command]
    module = __import__(module_name, fromlist=[builder])
    monkeypatch.setattr(sys, 'argv', [f'/venv/bin/{command}', '--help'])
    parser = getattr(module, builder)()
    assert parser.format_usage().startswith(f'usage: {command} ')
    assert '(default: None)' not in parser.format_help() and '(default: False)' not in parser.format_help()
    monkeypatch.setattr(sys, 'argv', [__import__(run_module, fromlist=['_']).__file__, '--help'])  # python -m
    assert getattr(module, builder)().format_usage().startswith(f'usage: python -m {run_module} ')


def test_module_commands_say_python_dash_m(monkeypatch):
    from lipsformer.hub.__main__ import build_hub_parser
    from lipsformer.hub.convert import build_convert_parser
    from lipsformer.lipschitz import __main__ as lipschitz_main
    monkeypatch.setattr(sys, 'argv', [lipschitz_main.__file__])
    from lipsformer.lipschitz.report_command import build_lipschitz_parser
    assert build_lipschitz_parser().format_usage().startswith('usage: python -m lipsformer.lipschitz ')
    assert '(default: None)' not in build_lipschitz_parser().format_help()
    assert '(default: 10)' in build_lipschitz_parser().format_help()  # real defaults are still shown
    monkeypatch.setattr(sys, 'argv', ['validate.py'])  # the repository's script
    from lipsformer.evaluation.validate_command import build_validate_parser
    assert build_validate_parser().format_usage().startswith('usage: validate.py ')
    for parser in (build_convert_parser(), build_hub_parser()):
        assert '(default: None)' not in parser.format_help()
