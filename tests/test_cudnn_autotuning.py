"""cuDNN's autotuning (``torch.backends.cudnn.benchmark``) as timm's scripts use it: on by default in training,
validation and the benchmark, off with each command's switch (``train.cudnn_benchmark``, ``--no-cudnn-benchmark``),
set in one place (lipsformer.utils.processes.set_cudnn_benchmark) and recorded with the run's settings. On the CPU the
flag changes no kernel, so these tests read the process-wide setting each command leaves and what its records say."""
import json
import os
from contextlib import redirect_stdout
from io import StringIO

import pytest
import safetensors.torch
import timm
import torch
import yaml
from image_data import make_image_folder
from process_support import single_thread
from training_support import tiny_overrides

from lipsformer.evaluation import validate_command
from lipsformer.instruments import benchmark
from lipsformer.training import ConfigError, load_config, session, train
from lipsformer.training.train_command import main as train_main
from lipsformer.utils.processes import set_cudnn_benchmark

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, 'configs', 'quickstart.yaml')


@pytest.fixture
def autotuning():
    """The process-wide setting, restored after the test whatever the test set it to."""
    before = torch.backends.cudnn.benchmark
    try:
        yield
    finally:
        torch.backends.cudnn.benchmark = before


def test_the_shared_setter_sets_the_flag_and_refuses_what_is_not_a_bool(autotuning):
    assert set_cudnn_benchmark(False) is False and torch.backends.cudnn.benchmark is False
    assert set_cudnn_benchmark(True) is True and torch.backends.cudnn.benchmark is True
    with pytest.raises(ValueError, match=r"^train.cudnn_benchmark: got 'false' \(str\); expected true or false$"):
        set_cudnn_benchmark('false', 'train.cudnn_benchmark')
    assert torch.backends.cudnn.benchmark is True  # left as it was


@pytest.mark.parametrize('flags, expected', [([], True), (['--cudnn-benchmark'], True),
                                             (['--no-cudnn-benchmark'], False)])
def test_the_benchmark_autotunes_unless_told_not_to_and_its_report_says_which(flags, expected, autotuning, capsys):
    torch.backends.cudnn.benchmark = not expected
    report = benchmark.main(['--models', 'test_vit', '--img-size', '32', '--batch-size', '2', '--mode', 'infer',
                             '--warmup', '0', '--repeats', '1', '--threads', '1', '--no-memory',
                             '--no-retain-cpu-memory', *flags])
    assert torch.backends.cudnn.benchmark is expected
    assert report['config']['cudnn_benchmark'] is expected
    assert '--cudnn-benchmark' in benchmark._parser().format_help()


def test_the_benchmark_s_fresh_processes_take_the_setting_too(autotuning):
    """The peak-memory child configures its process from the same config (_configure_process)."""
    for enabled in (False, True):
        benchmark._configure_process(benchmark.BenchmarkConfig(retain_cpu_memory=False, cudnn_benchmark=enabled))
        assert torch.backends.cudnn.benchmark is enabled


@pytest.mark.parametrize('flags, expected', [([], True), (['--no-cudnn-benchmark'], False)])
def test_validate_autotunes_unless_told_not_to_and_records_it(flags, expected, autotuning, fresh_accelerator,
                                                              tmp_path, capsys):
    data = make_image_folder(str(tmp_path / 'data'), train_per_class=1, val_per_class=2)
    model = timm.create_model('test_vit', img_size=32, num_classes=4)
    checkpoint = str(tmp_path / 'vit.safetensors')
    safetensors.torch.save_file(model.state_dict(), checkpoint)
    results = tmp_path / 'results.json'
    torch.backends.cudnn.benchmark = not expected
    code = validate_command.main(['--model', 'test_vit', '--checkpoint', checkpoint, '--img-size', '32',
                                  '--num-classes', '4', '--data-dir', os.path.join(data, 'validation'),
                                  '--data-layout', 'imagefolder', '--batch-size', '8', '--workers', '0', '--cpu',
                                  '--results-file', str(results), *flags])
    assert code == 0, capsys.readouterr().err
    assert torch.backends.cudnn.benchmark is expected
    assert json.loads(results.read_text())['settings']['cudnn_benchmark'] is expected


def test_the_training_key_defaults_to_on_and_its_flags_set_it():
    assert load_config(None).train.cudnn_benchmark is True
    for flag, expected in (('--cudnn-benchmark', True), ('--no-cudnn-benchmark', False)):
        out = StringIO()
        with redirect_stdout(out):
            assert train_main(['--config', QUICKSTART, '--print-config', flag]) == 0
        assert yaml.safe_load(out.getvalue())['train']['cudnn_benchmark'] is expected


def test_the_training_key_refuses_a_value_that_is_not_a_bool(tmp_path):
    with pytest.raises(ConfigError, match=r"train.cudnn_benchmark: got 'sometimes' \(str\); expected true or false"):
        load_config(None, ['train.cudnn_benchmark=sometimes'])
    config = load_config(None, ['log.trackers=[]'])
    config.train.cudnn_benchmark = 'no'  # a Config changed in Python: 'no' would read as true
    with pytest.raises(ConfigError, match=r"^train.cudnn_benchmark: got 'no' \(str\); expected true or false$"):
        train(config, str(tmp_path / 'run'))


@pytest.mark.parametrize('overrides, expected', [
    ([], True), (['train.cudnn_benchmark=false'], False),
    (['train.deterministic=true'], False),  # timed picks differ between runs: no bit-exact results with them
])
def test_training_sets_the_flag_as_its_config_says(overrides, expected, autotuning, fresh_accelerator, tmp_path):
    config = load_config(None, [*overrides, 'log.trackers=[]', 'train.device=cpu',
                                'train.cpu_retain_freed_memory=false'])
    torch.backends.cudnn.benchmark = not expected
    session.create_accelerator(config, str(tmp_path))
    assert torch.backends.cudnn.benchmark is expected


def test_a_training_run_records_in_its_summary_whether_cudnn_autotuned(autotuning, tmp_path, caplog):
    data_dir = make_image_folder(str(tmp_path / 'data'), train_per_class=4, val_per_class=2)
    overrides = tiny_overrides(data_dir, **{'train.epochs': 1, 'checkpoint.export': False})
    torch.backends.cudnn.benchmark = True
    with single_thread():
        assert train_main([*overrides, '--output', str(tmp_path / 'run'), '--no-cudnn-benchmark']) == 0
    summary = json.loads((tmp_path / 'run' / 'summary.json').read_text())
    assert summary['cudnn_benchmark'] is False and torch.backends.cudnn.benchmark is False
    assert yaml.safe_load((tmp_path / 'run' / 'config.yaml').read_text())['train']['cudnn_benchmark'] is False
