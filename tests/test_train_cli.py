"""train.py's command line: timm train.py's flags as aliases of config keys, options and overrides in any order."""
import contextlib
import io
import json
import os

import pytest
import yaml
from image_data import make_image_folder
from process_support import single_thread
from training_support import tiny_overrides

from lipsformer.training.config_io import config_from_dict
from lipsformer.training.optim import lr_scale
from lipsformer.training.train_command import TIMM_ALIASES, main, parse_args, run_folder

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, 'configs', 'quickstart.yaml')

# The timm train.py flags that train.py accepts, each with a value and the config key and value it must set.
TIMM_FLAGS = [
    (['--model', 'resnet18'], 'model.name', 'resnet18'),
    (['-b', '64'], 'train.batch_size', 64),
    (['--batch-size', '32'], 'train.batch_size', 32),
    (['--lr', '5e-4'], 'optimizer.lr', 5e-4),
    (['--epochs', '7'], 'train.epochs', 7),
    (['--warmup-epochs', '3'], 'scheduler.warmup_epochs', 3.0),
    (['--weight-decay', '0.1'], 'optimizer.weight_decay', 0.1),
    (['--amp'], 'train.mixed_precision', 'fp16'),
    (['--amp', '--amp-dtype', 'bfloat16'], 'train.mixed_precision', 'bf16'),
    (['--no-model-ema'], 'ema.enabled', False),
    (['--model-ema'], 'ema.enabled', True),
    (['--pretrained'], 'model.pretrained', True),
    (['--initial-checkpoint', 'w.safetensors'], 'model.init_checkpoint', 'w.safetensors'),
    (['--num-classes', '10'], 'model.num_classes', 10),
    (['--img-size', '64'], 'model.img_size', 64),
    (['--grad-accum-steps', '4'], 'train.grad_accum_steps', 4),
    (['--torchcompile'], 'model.compile', True),
    (['--no-torchcompile'], 'model.compile', False),
    (['--torchcompile-mode', 'reduce-overhead'], 'model.compile_mode', 'reduce-overhead'),
    (['--torchcompile-scope', 'whole'], 'model.compile_scope', 'whole'),
    (['-j', '3'], 'data.num_workers', 3),
    (['--workers', '5'], 'data.num_workers', 5),
    (['--scale', '0.5', '1'], 'augment.scale', [0.5, 1.0]),
    (['--opt', 'sgd'], 'optimizer.name', 'sgd'),
    (['--log-wandb'], 'log.trackers', ['tensorboard', 'wandb']),  # null: TensorBoard (installed), + wandb
    (['--log-wandb', 'log.trackers=[all]'], 'log.trackers', ['all']),
]


def _resolved(*argv: str, config: str = QUICKSTART) -> dict:
    resolved, _ = _print_config(*argv, config=config)
    return resolved


def _print_config(*argv: str, config: str = QUICKSTART) -> tuple[dict, int]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        code = main(['--config', config, '--print-config', *argv])
    return (yaml.safe_load(out.getvalue()) if code == 0 else {}), code


def _get(config: dict, key: str):
    for part in key.split('.'):
        config = config[part]
    return config


@pytest.mark.parametrize('argv, key, value', TIMM_FLAGS)
def test_timm_flags_set_their_config_keys(argv, key, value):
    assert _get(_resolved(*argv), key) == value


def test_help_names_the_key_each_flag_sets(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(['--help'])
    assert exit_info.value.code == 0
    text = ' '.join(capsys.readouterr().out.split())  # argparse wraps lines
    for argv, key, _ in TIMM_FLAGS:
        assert argv[0] in text
    for alias in TIMM_ALIASES:
        metavar = alias.key.split('.')[-1].upper()
        assert f'{", ".join(f"{f} {metavar}" for f in alias.flags)}' in text or alias.switch, alias.flags
        assert alias.key in text
    assert 'train.mixed_precision' in text and 'the absolute peak lr' in text


def test_options_and_overrides_mix_in_any_order(tmp_path):
    argv = ['--config', QUICKSTART, 'train.epochs=2', '--output', str(tmp_path / 'D'), 'optimizer.lr=1e-4', '-b', '16',
            'ema.decay=0.9']
    args = parse_args(argv)
    assert args.config == QUICKSTART and args.output == str(tmp_path / 'D')
    assert args.overrides == ['train.epochs=2', 'optimizer.lr=1e-4', 'ema.decay=0.9']
    config = _resolved(*argv[2:])
    assert (config['train']['epochs'], config['train']['batch_size'], config['ema']['decay']) == (2, 16, 0.9)
    assert config['optimizer']['lr'] == 1e-4


def test_a_flag_and_an_override_that_disagree_are_an_error(caplog):
    assert _print_config('--lr', '1e-3', 'optimizer.lr=3e-3')[1] == 2
    assert "--lr sets optimizer.lr=0.001 but the override sets optimizer.lr=0.003" in caplog.text
    assert _print_config('-b', '8', 'train.batch_size=8')[0]['train']['batch_size'] == 8  # agreeing is fine
    assert _print_config('--lr', '1e-3', 'optimizer.lr_base_batch_size=1024')[1] == 2  # --lr is absolute
    assert 'optimizer.lr_base_batch_size' in caplog.text
    assert _print_config('--lr', '1e-3', '--lr-base', '2e-3')[1] == 2
    assert '--lr-base sets optimizer.lr=0.002 but --lr sets it to 0.001' in caplog.text
    assert _print_config('--no-amp', 'train.mixed_precision=bf16')[1] == 2
    assert _print_config('--log-wandb', 'log.trackers=[tensorboard]')[1] == 2
    assert '--log-wandb adds wandb but the override log.trackers' in caplog.text


def test_unknown_options_are_refused_with_the_closest_one(capsys):
    with pytest.raises(SystemExit) as exit_info:
        parse_args(['--config', QUICKSTART, '--bacth-size', '8'])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert 'unknown option --bacth-size (did you mean --batch-size?)' in err and 'key.sub=value' in err
    with pytest.raises(SystemExit):
        parse_args(['--lr-bas', '1e-3'])  # no abbreviations: a prefix of --lr-base is not taken for it
    assert _print_config('--epochs', 'ten')[1] == 2  # a value of the wrong type names the key


def test_lr_is_absolute_as_in_timm_and_lr_base_is_scaled():
    """timm's --lr is the lr used whatever the batch; ours is given at lr_base_batch_size (2048) unless null."""
    paper = os.path.join(REPO, 'configs', 'lipsformer_cswin_tiny.yaml')
    assert lr_scale(config_from_dict(_resolved(config=paper)), 1024) == 0.5  # the paper's lr is for batch 2048
    absolute = config_from_dict(_resolved('--lr', '1e-3', config=paper))
    assert absolute.optimizer.lr == 1e-3 and lr_scale(absolute, 4096) == 1.0
    scaled = config_from_dict(_resolved('--lr-base', '1e-3', '--lr-base-size', '256', config=paper))
    assert scaled.optimizer.lr == 1e-3 and lr_scale(scaled, 1024) == 4.0
    decay = config_from_dict(_resolved('--model-ema-decay', '0.999', config=paper))
    assert (decay.ema.decay, decay.ema.reference_batch_size) == (0.999, None)


def test_experiment_names_the_run_folder_inside_output():
    assert run_folder(parse_args(['--output', 'out', '--experiment', 'e1'])) == os.path.join('out', 'e1')
    assert run_folder(parse_args(['--experiment', 'e1'])) == os.path.join('runs', 'e1')
    assert run_folder(parse_args(['--config', QUICKSTART])) == os.path.join('runs', 'quickstart')


def test_a_run_from_timm_flags_mixed_with_overrides(tmp_path):
    data_dir = make_image_folder(str(tmp_path / 'data'))
    flagged = ('train.batch_size=', 'optimizer.lr=', 'data.num_workers=')  # set by the flags below instead
    overrides = [o for o in tiny_overrides(data_dir, **{'train.epochs': 1}) if not o.startswith(flagged)]
    argv = [overrides[0], '--output', str(tmp_path / 'runs'), *overrides[1:], '--experiment', 'flags', '-b', '4',
            '--lr', '1e-3', '--no-model-ema', '-j', '0']
    with single_thread():
        assert main(argv) == 0
    run = tmp_path / 'runs' / 'flags'
    saved = yaml.safe_load((run / 'config.yaml').read_text())
    assert saved['train']['batch_size'] == 4 and saved['optimizer']['lr'] == 1e-3 and not saved['ema']['enabled']
    lines = [json.loads(line) for line in (run / 'metrics.jsonl').read_text().splitlines()]
    assert lines[-1]['epoch'] == 1 and 'ema_val_top1' not in lines[-1]


def _fails_with(argv: list[str], caplog) -> str:
    """train.py's exit status 2 and its last log line."""
    with single_thread():
        assert main(argv) == 2
    return caplog.records[-1].getMessage()


def test_fp16_on_a_cpu_is_refused_with_the_bf16_alternative(tmp_path, caplog):
    """Accelerate trains fp32 on a CPU asked for fp16, while config.yaml would record fp16."""
    data_dir = make_image_folder(str(tmp_path / 'data'))
    message = _fails_with([*tiny_overrides(data_dir), '--output', str(tmp_path / 'run'), '--amp', '--device', 'cpu'],
                          caplog)
    assert 'train.mixed_precision fp16 (--amp) runs only on a GPU' in message
    assert '--amp --amp-dtype bfloat16' in message and 'train.mixed_precision=bf16' in message
    assert not (tmp_path / 'run' / 'config.yaml').exists()


def test_an_output_that_is_a_file_is_a_bad_input_not_a_disk_problem(tmp_path, caplog):
    a_file = tmp_path / 'notes.txt'
    a_file.write_text('')
    for output, problem in ((a_file, 'it is a file'), (a_file / 'run', f'{str(a_file)!r} is a file, not a folder')):
        message = _fails_with([*tiny_overrides(str(tmp_path)), '--output', str(output)], caplog)
        assert f'--output {str(output)!r} cannot be a run folder: {problem}' in message
        assert 'free space' not in message


def test_resume_naming_a_file_says_what_it_is(tmp_path, caplog):
    data_dir = make_image_folder(str(tmp_path / 'data'))
    run = tmp_path / 'run'
    with single_thread():
        assert main([*tiny_overrides(data_dir, **{'train.epochs': 1}), '--output', str(run)]) == 0
    weights = run / 'checkpoints' / 'epoch_0001' / 'model.safetensors'
    message = _fails_with([*tiny_overrides(data_dir), '--output', str(run), '--resume', str(weights)], caplog)
    assert 'no such folder' not in message
    assert (f'--resume {str(weights)!r} is a file; give the checkpoint folder that holds it '
            f'({str(weights.parent)!r}), a run folder or auto') in message


def test_a_ctrl_c_during_set_up_is_not_called_a_second_one(tmp_path, caplog, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr('lipsformer.training.train_command.train', interrupted)
    with single_thread():
        assert main([*tiny_overrides(str(tmp_path)), '--output', str(tmp_path / 'run')]) == 130
    message = caplog.records[-1].getMessage()
    assert 'second' not in message
    assert message.startswith('interrupted by Ctrl-C outside the training loop (set-up or the final export)')


def test_an_empty_override_value_says_it_is_empty(caplog):
    assert main(['--print-config', 'data.dataset=']) == 2
    assert ("data.dataset: got an empty value (YAML null); expected a string: data.dataset=\"''\" gives an empty "
            "string") in caplog.records[-1].getMessage()


def test_a_rejected_model_keyword_is_the_one_named(tmp_path, caplog):
    """A Swin recipe's kwargs on CSwin: only window_size is wrong, and only it is named."""
    data_dir = make_image_folder(str(tmp_path / 'data'))
    kwargs = "{embed_dim: 16, depths: [1, 1, 1, 1], num_heads: [2, 2, 2, 2], split_size: [1, 2, 2, 2], window_size: 4}"
    message = _fails_with([*tiny_overrides(data_dir), 'model.name=lipsformer_cswin_tiny', f'model.kwargs={kwargs}',
                           '--output', str(tmp_path / 'run')], caplog)
    assert "model.kwargs: lipsformer_cswin_tiny does not accept ['window_size'] (" in message
