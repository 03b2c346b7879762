"""The benchmark harness (lipsformer.instruments.benchmark) on tiny timm models: report schema, ratios, counts, memory,
CLI."""
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import textwrap

import pytest
import timm
import torch

from lipsformer.instruments import benchmark
from lipsformer.instruments.benchmark import (
    BenchmarkConfig,
    ModelSpec,
    _build,
    _make_step,
    interleaved_order,
    main,
    parse_model_specs,
    report_table,
    run_benchmark,
    saved_activations_mb,
)
from lipsformer.instruments.complexity import model_complexity

MODELS = ['resnet10t', 'test_vit']  # the first has weights big enough (20 MB) to move the resident size
# glibc's defaults here: retaining freed memory would change the allocator of the whole test process.
CONFIG = BenchmarkConfig(batch_size=2, img_size=32, warmup=1, repeats=3, memory=True, retain_cpu_memory=False)


@pytest.fixture(scope='module')
def report():
    return run_benchmark(','.join(MODELS), ['infer', 'train'], CONFIG)


def test_report_schema(report):
    assert report['config']['models'] == MODELS and report['config']['modes'] == ['infer', 'train']
    assert report['config']['steps'] == 1 and report['config']['batch_size'] == 2
    assert {'torch', 'timm', 'cpu', 'torch_threads', 'memory_metric', 'load_average_start', 'load_average_end'} <= set(
        report['environment'])
    assert [(row['model'], row['mode']) for row in report['results']] == [
        (model, mode) for mode in ('infer', 'train') for model in MODELS]
    for row in report['results']:
        assert row['input_size'] == [3, 32, 32] and row['batch_size'] == 2
        assert len(row['images_per_s_samples']) == CONFIG.repeats
        assert all(value > 0 for value in row['images_per_s_samples'])
        assert row['images_per_s'] == statistics.median(row['images_per_s_samples'])
        assert row['ms_per_step'] == pytest.approx(1e3 * 2 / row['images_per_s'])
        assert len(row['page_faults_per_step_samples']) == CONFIG.repeats
        assert all(value >= 0 for value in row['page_faults_per_step_samples'])
        assert row['page_faults_per_step'] == statistics.median(row['page_faults_per_step_samples'])
    assert report['environment']['cpu_freed_memory_retained'] is False  # as CONFIG asks
    assert 'native_kernels' not in report['environment']  # the C kernels were removed
    assert report['environment']['cpu_details']['isa'] == torch.backends.cpu.get_cpu_capability()
    json.dumps(report)  # JSON-ready as it is


def test_ratios_are_quotients_of_the_reported_throughput(report):
    for mode in ('infer', 'train'):
        first, *others = [row for row in report['results'] if row['mode'] == mode]
        assert first['ratio'] == 1.0 and first['memory_ratio'] == 1.0
        for row in others:
            assert row['ratio'] == pytest.approx(row['images_per_s'] / first['images_per_s'], rel=1e-12)
            assert row['memory_ratio'] == pytest.approx(row['peak_memory_mb'] / first['peak_memory_mb'], rel=1e-12)


def test_ratio_spread_pairs_the_models_of_each_repeat(report):
    for mode in ('infer', 'train'):
        first, second = [row for row in report['results'] if row['mode'] == mode]
        assert first['ratio_samples'] == [1.0] * CONFIG.repeats and first['ratio_quartiles'] == [1.0, 1.0]
        assert first['ratio_median'] == 1.0
        expected = [ours / theirs for ours, theirs in zip(second['images_per_s_samples'],
                                                          first['images_per_s_samples'])]
        assert second['ratio_samples'] == pytest.approx(expected, rel=1e-12)
        # Three samples: the inclusive quartiles are the midpoints between the median and the extremes.
        low, middle, high = sorted(expected)
        assert second['ratio_quartiles'] == pytest.approx([(low + middle) / 2, (middle + high) / 2], rel=1e-12)
        assert second['ratio_median'] == pytest.approx(middle, rel=1e-12)


def test_the_table_shows_each_row_with_its_paired_ratio(report):
    text, markdown = report_table(report).splitlines(), report_table(report, markdown=True).splitlines()
    assert len(text) == 1 + len(report['results']) and len(markdown) == 2 + len(report['results'])
    assert 'paired ratio (IQR)' in text[0]
    for line, row in zip(markdown[2:], report['results']):
        cells = [cell.strip() for cell in line.strip('|').split('|')]
        assert cells[:4] == [row['model'], row['mode'], f'{row["images_per_s"]:.2f}', f'{row["ratio"]:.3f}']
        assert cells[4] == '{:.3f} ({:.3f}-{:.3f})'.format(row['ratio_median'], *row['ratio_quartiles'])
        assert cells[-1] == '-' and row['compile'] is None  # eager, as CONFIG asks
        assert row['fast_path'] is True and 'native_kernels' not in row  # the CPU's default


def test_ratio_quartiles_of_a_single_repeat():
    report = run_benchmark(','.join(MODELS), ['infer'], BenchmarkConfig(
        batch_size=1, img_size=32, warmup=0, repeats=1, memory=False, retain_cpu_memory=False))
    first, second = report['results']
    assert second['ratio_quartiles'] == [second['ratio_samples'][0]] * 2 == [second['ratio']] * 2
    assert second['ratio_median'] == second['ratio']


def test_counts_and_tflops_come_from_complexity(report):
    for row in report['results']:
        counts = model_complexity(row['model'], img_size=32)
        assert row['params'] == counts['params'] and row['gmacs'] == counts['gmacs']
        work = 3 if row['mode'] == 'train' else 1  # backward costs twice the forward
        assert row['tflops'] == pytest.approx(2 * work * counts['gmacs'] * row['images_per_s'] / 1e3)


def test_peak_memory_holds_weights_gradients_and_adam_state(report):
    rows = {(row['model'], row['mode']): row for row in report['results']}
    params = rows['resnet10t', 'train']['params']
    mib = 2 ** 20
    # fp32 training keeps weights, gradients and AdamW's two moments: 16 bytes per parameter at least.
    assert rows['resnet10t', 'train']['peak_memory_mb'] >= 16 * params / mib
    assert rows['resnet10t', 'infer']['peak_memory_mb'] >= 4 * params / mib
    assert rows['resnet10t', 'train']['peak_memory_mb'] > rows['resnet10t', 'infer']['peak_memory_mb']


def test_saved_activations_are_reported_for_training_rows(report):
    for row in report['results']:
        if row['mode'] == 'infer':
            assert row['saved_activations_mb_per_image'] is None and row['saved_activations_ratio'] is None
        else:
            assert row['saved_activations_mb_per_image'] > 0
    first, second = [row for row in report['results'] if row['mode'] == 'train']
    assert first['saved_activations_ratio'] == 1.0
    assert second['saved_activations_ratio'] == pytest.approx(
        second['saved_activations_mb_per_image'] / first['saved_activations_mb_per_image'], rel=1e-12)


def test_saved_activations_count_each_storage_once_without_parameters():
    # Linear saves its input (weights are parameters, left out); ReLU saves its output, which the second Linear saves
    # again as its input (the same storage, counted once); the second Linear's output is saved by nothing.
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4)).eval()
    inputs = torch.randn(2, 8)
    expected_bytes = 4 * (2 * 8 + 2 * 16)
    measured = saved_activations_mb(model, inputs, BenchmarkConfig())
    assert measured == pytest.approx(expected_bytes / 2 ** 20 / 2, rel=1e-12)
    assert not model.training  # the model's mode is restored


def test_saved_activations_count_a_saved_view_at_its_base_size():
    class FirstHalfSquared(torch.nn.Module):
        def forward(self, x):
            return (2 * x)[:, :4].square()  # square saves a view of the (2, 8) product: the whole product stays alive

    measured = saved_activations_mb(FirstHalfSquared(), torch.randn(2, 8, requires_grad=True), BenchmarkConfig())
    assert measured == pytest.approx(4 * 2 * 8 / 2 ** 20 / 2, rel=1e-12)


def test_models_are_interleaved_and_alternate_direction():
    order = interleaved_order(3, 4)
    assert order == [[0, 1, 2], [2, 1, 0], [0, 1, 2], [2, 1, 0]]


def test_warm_up_steps_are_interleaved_like_the_timed_ones(monkeypatch):
    calls, first, second = [], torch.nn.Identity(), torch.nn.Identity()
    monkeypatch.setattr(benchmark, '_make_step', lambda model, inputs, mode, config, spec: lambda: calls.append(
        'a' if model is first else 'b'))
    config = BenchmarkConfig(warmup=3, repeats=2)
    runs = benchmark._time_mode([(first, None), (second, None)], 'train', config,
                                   [ModelSpec('a', 'a'), ModelSpec('b', 'b')])
    assert calls == ['a', 'b', 'b', 'a', 'a', 'b'] + ['a', 'b', 'b', 'a']  # three warm-up rounds, then the repeats
    assert [len(model_runs) for model_runs in runs.runs] == [2, 2]
    assert all(seconds >= 0 for seconds in runs.first_step_s) and runs.profiles == [None, None]
    assert runs.cuda_peak_memory_mb is None  # on the CPU


def test_train_step_updates_weights_and_infer_step_does_not():
    config = BenchmarkConfig(batch_size=2, img_size=32)
    model, inputs = _build(ModelSpec('test_vit', 'test_vit'), config)
    before = [parameter.detach().clone() for parameter in model.parameters()]
    _make_step(model, inputs, 'infer', config)()
    assert all(torch.equal(old, new) for old, new in zip(before, model.parameters()))
    _make_step(model, inputs, 'train', config)()
    assert model.training and all(parameter.grad is not None for parameter in model.parameters())
    assert sum(not torch.equal(old, new) for old, new in zip(before, model.parameters())) == len(before)


@pytest.mark.parametrize('precision', ['bf16', 'fp16'])
def test_reduced_precision_autocasts_the_forward(precision):
    config = BenchmarkConfig(batch_size=2, img_size=32, precision=precision, channels_last=True)
    model, inputs = _build(ModelSpec('resnet10t', 'resnet10t'), config)
    assert inputs.is_contiguous(memory_format=torch.channels_last)
    dtypes = []
    model.fc.register_forward_hook(lambda module, args, output: dtypes.append(output.dtype))
    for mode in ('infer', 'train'):
        _make_step(model, inputs, mode, config)()
    assert dtypes == [{'bf16': torch.bfloat16, 'fp16': torch.float16}[precision]] * 2
    assert all(parameter.dtype == torch.float32 for parameter in model.parameters())  # master weights stay fp32


def test_model_specs_parse_constructor_arguments_and_files():
    specs = parse_model_specs('test_vit[img_size=64,depth=(1, 2)], resnet10t,file:/x/m.py:make[width=8,act=gelu]')
    assert [spec.source for spec in specs] == ['test_vit', 'resnet10t', 'file:/x/m.py:make']
    assert specs[0].kwargs == {'img_size': 64, 'depth': (1, 2)} and specs[1].kwargs == {}
    assert specs[2].kwargs == {'width': 8, 'act': 'gelu'} and specs[2].is_file


def test_model_specs_take_lists_at_any_depth():
    text = ('lipsformer_swin_tiny[embed_dim=16,depths=[1,1,2,1],num_heads=[1, 2, 2, 4]],'
            'lipsformer_cswin_tiny[split_size=[1,2,(2),2],depths=(1,1,2,1)],test_vit[depth=1]')
    swin, cswin, vit = parse_model_specs(text)
    assert swin.kwargs == {'embed_dim': 16, 'depths': [1, 1, 2, 1], 'num_heads': [1, 2, 2, 4]}
    assert cswin.kwargs == {'split_size': [1, 2, 2, 2], 'depths': (1, 1, 2, 1)} and vit.kwargs == {'depth': 1}
    assert swin.text == 'lipsformer_swin_tiny[embed_dim=16,depths=[1,1,2,1],num_heads=[1, 2, 2, 4]]'


@pytest.mark.parametrize('text, message', [
    ('swin_tiny_patch4_window7_2244', 'no timm model matches'),
    ('swin_tiny*', 'exact model names'),
    ('test_vit[img_size]', 'key=value'),
    ('file:/x/m.py', 'file:/path/to/module.py:factory_name'),
    ('test_vit,test_vit', 'listed twice'),
    (' , ', 'no model given'),
])
def test_bad_model_specs_say_what_is_wrong(text, message):
    with pytest.raises(ValueError, match=message):
        parse_model_specs(text)


def test_a_model_spec_can_switch_the_fast_paths_off_for_its_model():
    """``fast_path=False`` times the plain module graph of a model beside its fast path, in one process: it is no
    constructor argument, and it switches lipsformer.fastpath off only while that model runs; ``fast_path=True``
    switches it on whatever the device's default, and a spec without it follows the device's default."""
    from tiny_models import TINY_CSWIN

    from lipsformer.fastpath import use_fast_path
    shape = ','.join(f'{key}={list(value) if isinstance(value, tuple) else value}' for key, value in TINY_CSWIN.items())
    fast, plain = parse_model_specs(f'lipsformer_cswin_tiny[{shape}],lipsformer_cswin_tiny[{shape},fast_path=False]')
    assert fast.fast_path is None and plain.fast_path is False and 'fast_path' not in plain.kwargs
    assert plain.running(use_fast_path)() is False and fast.running(use_fast_path)() is True and use_fast_path()
    (forced,) = parse_model_specs('lipsformer_cswin_tiny[fast_path=True]')
    assert forced.running(lambda: use_fast_path('mps'))() is True and not fast.running(lambda: use_fast_path('mps'))()
    config = BenchmarkConfig(batch_size=2, img_size=64, memory=False)
    report = run_benchmark([fast, plain], ['train'], config)
    assert report['environment']['fast_path'] is True
    fast_row, plain_row = report['results']
    # The plain graph keeps GELU's outputs and alpha's products that the fast path's Functions do not.
    assert plain_row['saved_activations_mb_per_image'] > 1.2 * fast_row['saved_activations_mb_per_image']
    with pytest.raises(TypeError, match='fast_path must be True or False'):
        parse_model_specs('lipsformer_cswin_tiny[fast_path=0]')


def test_img_size_argument_must_be_one_integer():
    with pytest.raises(TypeError, match='one integer'):
        parse_model_specs('test_vit[img_size=(64, 32)]')


def test_missing_file_or_factory_is_reported(tmp_path):
    (tmp_path / 'models.py').write_text('WIDTH = 8\n\n\ndef make():\n    pass\n')
    with pytest.raises(ValueError, match='does not exist'):
        parse_model_specs(f'file:{tmp_path}/absent.py:make')[0].factory()
    with pytest.raises(ValueError, match=r"no callable 'build'.*\['make'\]"):
        parse_model_specs(f'file:{tmp_path}/models.py:build')[0].factory()
    with pytest.raises(TypeError, match=r"'WIDTH' is not callable \(int\)"):
        parse_model_specs(f'file:{tmp_path}/models.py:WIDTH')[0].factory()


@pytest.mark.parametrize('argv, message', [
    (['--models', 'resnet10', '--mode', 'infer'], 'did you mean'),
    (['--models', 'resnet10t', '--mode', 'infer,eval'], '--mode must be'),
    (['--models', 'resnet10t', '--batch-size', '0'], '--batch-size must be at least 1'),
    (['--models', 'resnet10t', '--device', 'tpu'], '--device must be'),
    (['--models', 'resnet10t', '--threads', '0'], '--threads must be at least 1'),
])
def test_cli_rejects_bad_arguments(argv, message, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert message in capsys.readouterr().err


STEP_FLAGS = ('--models', '--mode', '--batch-size', '--img-size', '--precision')


def test_the_benchmark_and_the_kernel_counter_share_one_definition_of_the_step_flags(capsys):
    """Both take the models and the step as lipsformer.instruments.model_specs defines them: the same types, choices and
    help, each with its own default batch size and precision, and the same usage errors."""
    from lipsformer.instruments import benchmark, kernel_count

    def actions(parser):
        return {flag: parser._option_string_actions[flag] for flag in STEP_FLAGS}

    ours, theirs = actions(benchmark._parser()), actions(kernel_count._parser())
    for flag in STEP_FLAGS:
        a, b = ours[flag], theirs[flag]
        assert (a.type, a.choices, a.required, a.help) == (b.type, b.choices, b.required, b.help), flag
        assert a.help and '%(default)s' in a.help or flag == '--models', flag
    assert (ours['--batch-size'].default, ours['--precision'].default) == (64, 'fp32')
    assert (theirs['--batch-size'].default, theirs['--precision'].default) == (128, 'bf16')
    for command in (benchmark.main, kernel_count.main):
        for argv, message in [
                (['--mode', 'infer,eval'], "--mode must be a comma list of infer, train, got 'infer,eval'"),
                (['--img-size', '0'], '--img-size must be at least 1, got 0')]:
            with pytest.raises(SystemExit) as stopped:
                command(['--models', 'resnet10t', *argv])
            assert stopped.value.code == 2 and message in capsys.readouterr().err, (command, argv)


def test_a_ctrl_c_while_the_report_so_far_is_written_waits_for_it(tmp_path, monkeypatch, capsys):
    """A Ctrl-C that lands while a finished mode is written (a real SIGINT to this process, from inside the write)
    lets the write end, so that the last line names the report that holds the mode."""
    real_write_report = benchmark.write_json_report

    def write_while_ctrl_c(parser, path, report, partial=False):
        if partial:
            os.kill(os.getpid(), signal.SIGINT)
        return real_write_report(parser, path, report, partial=partial)
    monkeypatch.setattr(benchmark, 'write_json_report', write_while_ctrl_c)
    out = tmp_path / 'report.json'
    with pytest.raises(SystemExit, match='130'):
        main(['--models', 'test_vit', '--img-size', '32', '--batch-size', '2', '--warmup', '0', '--repeats', '1',
              '--no-memory', '--no-retain-cpu-memory', '--mode', 'infer,train', '--json', str(out)])
    assert capsys.readouterr().err.splitlines()[-1] == (
        f"python -m lipsformer.instruments.benchmark: interrupted by Ctrl-C: the report so far (infer; complete false) "
        f"is in --json {str(out)!r}")
    assert [row['mode'] for row in json.loads(out.read_text())['results']] == ['infer']

def test_cli_end_to_end_with_a_model_outside_timm(tmp_path):
    # A factory that calls .item() while building cannot run on the meta device: its counts come from the built model.
    (tmp_path / 'outside.py').write_text(textwrap.dedent('''
        import torch
        from torch import nn

        def tiny_cnn(width=8, num_classes=10):
            width = int(torch.tensor(width).item())
            return nn.Sequential(nn.Conv2d(3, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1),
                                 nn.Flatten(), nn.Linear(width, num_classes))
    '''))
    out = tmp_path / 'report.json'
    models = f'test_vit[img_size=64],file:{tmp_path}/outside.py:tiny_cnn[width=16]'
    completed = subprocess.run(
        [sys.executable, '-m', 'lipsformer.instruments.benchmark', '--models', models, '--mode', 'infer,train',
         '--batch-size', '2',
         '--img-size', '32', '--warmup', '1', '--repeats', '2', '--threads', '1', '--no-memory', '--json', str(out)],
        check=True, capture_output=True, text=True)
    assert completed.stdout.splitlines()[0].split()[:4] == ['model', 'mode', 'img/s', 'ratio']
    saved = json.loads(out.read_text())
    assert saved['command'].startswith('python -m lipsformer.instruments.benchmark --models')
    assert saved['complete'] is True
    assert saved['environment']['torch_threads'] == 1 and saved['config']['threads'] == 1
    assert saved['config']['retain_cpu_memory'] is True  # the default, as in train.py
    vit, cnn = saved['results'][:2]
    assert vit['input_size'] == [3, 64, 64] and cnn['input_size'] == [3, 32, 32]
    assert cnn['params'] == (3 * 9 * 16 + 16) + (16 * 10 + 10)
    assert cnn['gmacs'] * 1e9 == pytest.approx(32 * 32 * 16 * 27 + 16 * 10)
    assert cnn['peak_memory_mb'] is None and cnn['memory_ratio'] is None
    assert len(completed.stdout.strip().splitlines()) == 1 + 4


def test_memory_ratio_is_none_when_the_first_model_moved_no_memory(monkeypatch):
    import lipsformer.instruments.benchmark as benchmark
    monkeypatch.setattr(benchmark, '_peak_memories', lambda specs, modes, config: {
        (spec.text, mode): value for spec, value in zip(specs, (0.0, 12.0)) for mode in modes})
    config = BenchmarkConfig(batch_size=2, img_size=32, warmup=0, repeats=1, retain_cpu_memory=False)
    rows = run_benchmark('test_vit,resnet10t', ['infer'], config)['results']
    assert [row['peak_memory_mb'] for row in rows] == [0.0, 12.0]
    assert [row['memory_ratio'] for row in rows] == [None, None]


def test_profile_and_kernel_counts_join_the_report(tmp_path):
    """``--profile`` adds a torch.profiler summary to every row (on the CPU: host ops only, no device kernels) and
    ``--count-kernels`` the counts of lipsformer.instruments.kernel_count, printed beside the speed table."""
    from lipsformer.instruments.kernel_count import unsupported_reason
    counting = unsupported_reason() is None  # else tested by test_kernel_counting_refuses_an_unsupported_torch
    out = tmp_path / 'report.json'
    completed = subprocess.run(
        [sys.executable, '-m', 'lipsformer.instruments.benchmark', '--models', 'test_vit[img_size=32]', '--mode',
         'infer,train',
         '--batch-size', '2', '--img-size', '32', '--warmup', '1', '--repeats', '1', '--threads', '1', '--no-memory',
         '--profile', '2', '--json', str(out)] + (['--count-kernels'] if counting else []),
        check=True, capture_output=True, text=True)
    report = json.loads(out.read_text())
    for row in report['results']:
        assert row['profile']['steps'] == 2 and row['profile']['kernels_per_step'] == 0
        assert row['profile']['timed_step_ms'] == pytest.approx(row['ms_per_step'])
        flash = 'aten::_scaled_dot_product_flash_attention_for_cpu'  # timm's ViT on the CPU
        assert row['profile']['sdpa_ops'] == [flash] + ([f'{flash}_backward'] if row['mode'] == 'train' else [])
        assert row['first_step_s'] > 0 and row['cuda_peak_memory_mb_in_process'] is None
    if not counting:
        return
    counts = {(row['model'], row['mode']): row for row in report['kernel_counts']}
    assert counts.keys() == {('test_vit[img_size=32]', mode) for mode in ('infer', 'train')}
    # test_vit's head dim (8) in fp32: the memory-efficient kernel, once a block
    assert counts['test_vit[img_size=32]', 'infer']['sdpa'] == {
        'forward: _scaled_dot_product_efficient_attention': len(timm.create_model('test_vit').blocks)}
    assert 'kernels/step' in completed.stdout and 'non-matmul GB' in completed.stdout


def test_the_short_module_name_runs_the_benchmark(tmp_path):
    """``python -m lipsformer.benchmark`` is the benchmark: it times the models it is given and names itself so in
    its usage errors."""
    out = tmp_path / 'report.json'
    subprocess.run([sys.executable, '-m', 'lipsformer.benchmark', '--models', 'test_vit[img_size=32]', '--mode',
                    'infer', '--batch-size', '2', '--img-size', '32', '--warmup', '0', '--repeats', '1', '--threads',
                    '1', '--no-memory', '--json', str(out)], check=True, capture_output=True, text=True)
    rows = json.loads(out.read_text())['results']
    assert [(row['model'], row['mode']) for row in rows] == [('test_vit[img_size=32]', 'infer')]
    assert rows[0]['images_per_s'] > 0
    refused = subprocess.run([sys.executable, '-m', 'lipsformer.benchmark', '--models', 'test_vit', '--mode', 'eval'],
                             capture_output=True, text=True)
    assert refused.returncode == 2
    assert refused.stderr.splitlines()[-1].startswith('python -m lipsformer.benchmark: error: '), refused.stderr


def test_compile_mode_needs_compile(capsys):
    with pytest.raises(SystemExit):
        main(['--models', 'resnet10t', '--compile-mode', 'reduce-overhead'])
    assert '--compile-mode needs --compile' in capsys.readouterr().err


def test_cli_an_input_size_a_model_cannot_take_is_a_one_line_error(capsys):
    tiny = 'lipsformer_swin_tiny[embed_dim=16,depths=(1,1,1,1),num_heads=(1,1,1,1),window_size=4]'
    with pytest.raises(SystemExit, match='2'):
        main(['--models', tiny, '--img-size', '100', '--mode', 'infer', '--steps', '1', '--repeats', '1',
              '--warmup', '0', '--no-memory'])
    err = capsys.readouterr().err
    assert 'error: --img-size 100: img_size must be a multiple of 32, got 100x100' in err and 'Traceback' not in err


@pytest.mark.parametrize('command', ['benchmark', 'kernel_count'])
@pytest.mark.parametrize('spec, message', [
    ('lipsformer_swin_tiny[fast_pth=False]', "'lipsformer_swin_tiny[fast_pth=False]': unknown key 'fast_pth'; did you "
                                             "mean fast_path?"),
    ('lipsformer_swin_tiny[windw_size=4]', "--models: 'lipsformer_swin_tiny[windw_size=4]': the model takes no "
                                           "argument 'windw_size'; did you mean window_size?"),
    ('lipsformer_swin_tiny', '--img-size 50: img_size must be a multiple of 32, got 50x50'),
    ('lipsformer_swin_tiny[native=False]', "'lipsformer_swin_tiny[native=False]': native= was removed with the "
                                           "package's C kernels"),
])
def test_cli_a_misspelt_key_or_a_size_a_model_cannot_take_is_a_one_line_error(command, spec, message, capsys):
    """A misspelt spec key or constructor argument is named with the one it most likely meant, and an input size
    the model refuses is named: exit 2 and one line (no usage block above it), in both commands that take model
    specs."""
    if command == 'kernel_count':
        from lipsformer.instruments.kernel_count import main as command_main
        from lipsformer.instruments.kernel_count import unsupported_reason
        if unsupported_reason():
            pytest.skip(unsupported_reason())
    else:
        command_main = main
    with pytest.raises(SystemExit, match='2'):
        command_main(['--models', spec, '--img-size', '50', '--mode', 'infer', '--batch-size', '1',
                      *(['--steps', '1', '--repeats', '1', '--warmup', '0', '--no-memory'] if command == 'benchmark'
                        else [])])
    err = capsys.readouterr().err
    prog = f'python -m lipsformer.instruments.{command}'
    assert err.splitlines()[-1].startswith(f'{prog}: error: {message}') and 'Traceback' not in err
    assert not [line for line in err.splitlines() if not line.startswith(('[benchmark]', f'{prog}: error: '))], err


@pytest.mark.parametrize('command', ['benchmark', 'kernel_count'])
def test_cli_an_unwritable_json_report_is_refused_before_any_model_runs(command, tmp_path, capsys, monkeypatch):
    """A folder (or a read-only place) as ``--json`` is a usage error at once, not a traceback after the run."""
    from lipsformer.instruments import kernel_count
    ran = []
    monkeypatch.setattr(benchmark, 'run_benchmark', lambda *args, **kwargs: ran.append(1))
    monkeypatch.setattr(kernel_count, 'count_models', lambda *args, **kwargs: ran.append(1))
    entry = benchmark.main if command == 'benchmark' else kernel_count.main
    with pytest.raises(SystemExit, match='2'):
        entry(['--models', 'lipsformer_swin_tiny', '--json', str(tmp_path)])
    err = capsys.readouterr().err
    assert f"--json {str(tmp_path)!r} cannot be written" in err and 'Traceback' not in err
    assert ran == []


def test_cli_a_failed_json_write_keeps_the_table_and_exits_4(tmp_path, capsys, monkeypatch):
    tiny = 'lipsformer_swin_tiny[embed_dim=16,depths=(1,1,1,1),num_heads=(1,1,1,1),window_size=4,img_size=32]'

    def full_disk(path, data, indent=2):
        raise OSError(28, 'No space left on device')

    from lipsformer.instruments import model_specs
    monkeypatch.setattr(model_specs, 'write_json', full_disk)
    report = tmp_path / 'new' / 'report.json'
    with pytest.raises(SystemExit, match='4'):
        main(['--models', tiny, '--img-size', '32', '--mode', 'infer', '--steps', '1', '--repeats', '1',
              '--warmup', '0', '--no-memory', '--batch-size', '2', '--json', str(report)])
    out, err = capsys.readouterr()
    assert 'lipsformer_swin_tiny' in out  # the table came first
    assert f"could not be written to --json {str(report)!r}: No space left on device" in err


def test_kernel_counting_refuses_an_unsupported_torch(capsys, monkeypatch):
    """Where fake CUDA tensors cannot run without a GPU (an older torch), counting is a one-line refusal, not an
    abort of the process."""
    from lipsformer.instruments import kernel_count
    monkeypatch.setattr(kernel_count, 'MIN_TORCH_WITHOUT_A_GPU', (99, 0))
    monkeypatch.setattr(torch.cuda, 'is_available', lambda: False)
    with pytest.raises(SystemExit, match='2'):
        main(['--models', 'test_vit[img_size=32]', '--count-kernels'])
    assert '--count-kernels: counting CUDA kernels without a GPU needs torch >= 99.0' in capsys.readouterr().err
    with pytest.raises(SystemExit, match='2'):
        kernel_count.main(['--models', 'test_vit[img_size=32]'])
    with pytest.raises(RuntimeError, match='needs torch >= 99.0'):
        kernel_count.count_step('test_vit[img_size=32]', 'infer', 2, 32)


def test_a_model_spec_can_take_its_own_compile_mode():
    """``compile`` is no constructor argument: ``compile=True`` is torch.compile's default mode, a mode string that
    mode, ``False`` eager whatever ``--compile`` says, and a spec without it follows ``--compile``."""
    default, eager, compiled, mode = parse_model_specs(
        "test_vit,test_vit[compile=False],test_vit[compile=True],test_vit[compile='reduce-overhead']")
    assert [spec.kwargs for spec in (default, eager, compiled, mode)] == [{}] * 4
    assert (compiled.compile, mode.compile, default.compile) == (True, 'reduce-overhead', None)
    plain, flagged = BenchmarkConfig(), BenchmarkConfig(compile=True, compile_mode='max-autotune')
    assert [benchmark.compile_mode(spec, plain) for spec in (default, eager, compiled, mode)] == [
        None, None, 'default', 'reduce-overhead']
    assert [benchmark.compile_mode(spec, flagged) for spec in (default, eager, compiled, mode)] == [
        'max-autotune', None, 'default', 'reduce-overhead']
    assert benchmark.compile_mode(None, BenchmarkConfig(compile=True)) == 'default'
    (bare,) = parse_model_specs('test_vit[compile=max-autotune-no-cudagraphs]')  # a bare word is a string too
    assert bare.compile == 'max-autotune-no-cudagraphs'


def test_spec_keys_name_the_compile_scope_and_its_mode():
    """``compile=regional`` / ``whole`` pick the scope, ``compile_mode`` the mode beside it; ``--compile-scope`` is the
    default of the specs without a scope, and a model without LipsFormer blocks compiles whole."""
    specs = parse_model_specs('lipsformer_cswin_tiny[compile=regional,compile_mode=reduce-overhead],'
                              'lipsformer_cswin_tiny[compile=whole,compile_mode=reduce-overhead],'
                              'lipsformer_swin_tiny[compile=True],lipsformer_swin_tiny[compile=whole],lipsformer_swin_tiny')
    assert [(benchmark.compile_mode(spec, BenchmarkConfig()), benchmark.compile_scope(spec, BenchmarkConfig()))
            for spec in specs] == [('reduce-overhead', 'regional'), ('reduce-overhead', 'whole'),
                                   ('default', 'regional'), ('default', 'whole'), (None, None)]
    whole = BenchmarkConfig(compile=True, compile_scope='whole')
    assert [benchmark.compile_scope(spec, whole) for spec in specs] == ['regional', 'whole', 'whole', 'whole', 'whole']
    assert benchmark.compile_scope(specs[2], BenchmarkConfig(), has_blocks=False) == 'whole'


def test_compile_scope_needs_compile(capsys):
    with pytest.raises(SystemExit, match='2'):
        main(['--models', 'resnet10t', '--compile-scope', 'whole'])
    assert '--compile-scope needs --compile' in capsys.readouterr().err


@pytest.mark.parametrize('text, error, message', [
    ('test_vit[compile=fast]', ValueError, r"'test_vit\[compile=fast\]': compile='fast' is no torch.compile scope or "
                                           r'mode; write compile=True \(the default mode and scope\), one of the '
                                           r'scopes regional, whole or of the modes default, .*reduce-over'),
    ('test_vit[compile=1]', TypeError, r"'test_vit\[compile=1\]': compile must be True, False, a scope or a "
                                       r'torch.compile mode'),
    ('test_vit[compile=False,compile_mode=default]', ValueError, r"compile_mode='default' with compile=False"),
    ('test_vit[compile_mode=regional]', ValueError, r"compile_mode='regional' is no torch.compile mode; write one of "
                                                    r'default'),
    ('test_vit[fast_path=0]', TypeError, r"'test_vit\[fast_path=0\]': fast_path must be True or False, got 0"),
    # native= went with the package's C kernels: refused, not handed to the constructor as an argument
    ('test_vit[native=False]', ValueError, r"'test_vit\[native=False\]': native= was removed with the package's C "
                                           r'kernels: the fast path runs its PyTorch code, as it did with '
                                           r"native=False; drop 'native=False' from the spec"),
    ('test_vit[img_size=32,native=True]', ValueError, r"native= was removed .*; drop 'native=True' from the spec"),
])
def test_bad_spec_keys_say_what_is_accepted(text, error, message, capsys):
    with pytest.raises(error, match=message):
        parse_model_specs(text)
    with pytest.raises(SystemExit, match='2'):
        main(['--models', text])
    assert re.search(message, capsys.readouterr().err)  # a usage error, before any model runs


def test_make_step_compiles_as_the_spec_says(monkeypatch):
    compiled = []
    monkeypatch.setattr(torch, 'compile', lambda model, mode=None, **kwargs: compiled.append(mode) or model)
    config = BenchmarkConfig(batch_size=2, img_size=32, compile=True)
    model, inputs = _build(ModelSpec('test_vit', 'test_vit'), config)
    eager, own_mode = parse_model_specs('test_vit[compile=False],test_vit[compile=max-autotune-no-cudagraphs]')
    _make_step(model, inputs, 'infer', config, eager)()
    assert compiled == []
    _make_step(model, inputs, 'infer', config, own_mode)()
    _make_step(model, inputs, 'train', BenchmarkConfig(batch_size=2, img_size=32))()
    _make_step(model, inputs, 'train', config)()  # no spec: --compile's mode
    assert compiled == ['max-autotune-no-cudagraphs', 'default']


def _spec_arguments(shape: dict) -> str:
    """A tiny model's keyword arguments as a model spec writes them: ``key=value,...``."""
    return ','.join(f'{key}={list(value) if isinstance(value, tuple) else value}' for key, value in shape.items())


def test_a_compiled_model_is_timed_beside_its_eager_form(monkeypatch):
    """``compile=True`` runs that model alone through torch.compile (dynamo for real; its eager backend here, for
    speed), interleaved with the eager one; the rows say which is which, and the first step times compilation."""
    import torch._dynamo
    from tiny_models import SMALLEST_SWIN

    compile_calls, real_compile = [], torch.compile
    monkeypatch.setattr(torch, 'compile', lambda model, mode=None, **kwargs: compile_calls.append(mode) or
                        real_compile(model, mode=None, backend='eager'))
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    tiny = f'lipsformer_swin_tiny[{_spec_arguments(SMALLEST_SWIN)}'
    specs = parse_model_specs(f'{tiny}],{tiny},compile=True]')
    report = run_benchmark(specs, ['infer'], BenchmarkConfig(
        batch_size=2, img_size=32, warmup=1, repeats=1, memory=False, retain_cpu_memory=False))
    eager, compiled = report['results']
    assert (eager['compile'], compiled['compile']) == (None, 'default')
    assert (eager['compile_scope'], compiled['compile_scope']) == (None, 'regional')
    assert compile_calls == ['default'] * 4  # each of the four blocks, in place
    assert eager['compile_s'] is None and compiled['compile_s'] == compiled['first_step_s'] > 0
    # compiled, lipsformer.fastpath steps aside for the plain graph
    assert (eager['fast_path'], compiled['fast_path']) == (True, False)
    assert torch._dynamo.utils.counters['stats']['unique_graphs'] >= 1  # dynamo traced the compiled model
    assert report_table(report).splitlines()[2].split()[-2:] == ['regional,', 'default']
    torch._dynamo.reset()


def test_the_report_is_written_after_each_mode_and_marked_complete_at_the_end(tmp_path, monkeypatch, capsys):
    """A run cut short by Ctrl-C (here: during the training mode) leaves the modes it finished in --json, ``complete``
    false, and ends with exit 130 and one line saying what was kept, as train.py does; without a finished mode or
    without --json, the line says nothing was kept."""
    real_time_mode = benchmark._time_mode
    interrupted_modes = {'train'}

    def interrupted(models, mode, config, specs):
        if mode in interrupted_modes:
            raise KeyboardInterrupt  # as Ctrl-C, or a time limit's SIGINT, would stop the run
        return real_time_mode(models, mode, config, specs)
    monkeypatch.setattr(benchmark, '_time_mode', interrupted)
    out = tmp_path / 'report.json'
    argv = ['--models', 'test_vit,resnet10t', '--img-size', '32', '--batch-size', '2', '--warmup', '0', '--repeats',
            '1', '--no-memory', '--no-retain-cpu-memory', '--json', str(out)]
    with pytest.raises(SystemExit, match='130'):
        main(argv + ['--mode', 'infer,train'])
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == (f"python -m lipsformer.instruments.benchmark: interrupted by Ctrl-C: the report so "
                                    f"far (infer; complete false) is in --json {str(out)!r}") and 'Traceback' not in err
    saved = json.loads(out.read_text())
    assert saved['complete'] is False
    assert saved['command'].startswith('python -m lipsformer.instruments.benchmark --models')
    assert [(row['model'], row['mode']) for row in saved['results']] == [('test_vit', 'infer'), ('resnet10t', 'infer')]
    assert saved['config']['modes'] == ['infer', 'train']
    finished = main(argv + ['--mode', 'infer'])
    assert json.loads(out.read_text()) == json.loads(json.dumps(finished)) and finished['complete'] is True
    interrupted_modes.add('infer')
    with pytest.raises(SystemExit, match='130'):
        main(argv[:-2] + ['--mode', 'infer'])
    assert capsys.readouterr().err.splitlines()[-1] == ('python -m lipsformer.instruments.benchmark: interrupted by '
                                                        'Ctrl-C: nothing was kept (--json FILE keeps each mode as it '
                                                        'finishes)')
