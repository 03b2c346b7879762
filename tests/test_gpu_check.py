"""The GPU check's parts that run on a CPU: the profile summary (lipsformer.instruments.step_profile), the time guard
and the step runner, the report writer, and scripts/gpu_check.sh itself with tiny models on the CPU."""
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from lipsformer.instruments import gpu_check
from lipsformer.instruments.gpu_check import Step, StepResult, guard, plan_steps, run_steps, write_gpu_report
from lipsformer.instruments.model_specs import parse_model_specs
from lipsformer.instruments.step_profile import TimedEvent, busy_time, kernel_kind, profile_steps, summarize

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / 'scripts' / 'gpu_check.sh'


def test_busy_time_counts_overlapping_kernels_once():
    events = [TimedEvent('a', 0, 10, True), TimedEvent('b', 5, 15, True), TimedEvent('c', 20, 25, True),
              TimedEvent('d', 21, 22, True)]
    assert busy_time(events) == 15 + 5
    assert busy_time([]) == 0


def test_profile_summary_per_step():
    kernel = 'void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits<64, 128>>'
    events = [
        TimedEvent('aten::_scaled_dot_product_flash_attention', 0, 50, False),
        TimedEvent('aten::add', 50, 60, False),
        TimedEvent(kernel, 10, 40, True), TimedEvent('elementwise_add', 40, 50, True),
        TimedEvent(kernel, 110, 140, True), TimedEvent('elementwise_add', 150, 160, True),
        TimedEvent('aten::add', 150, 200, False),
    ]
    summary = summarize(events, steps=2, step_ms=0.1)
    assert summary['kernels_per_step'] == 2
    assert summary['device_busy_ms_per_step'] == pytest.approx((30 + 10 + 30 + 10) / 2 / 1e3)
    assert summary['busy_fraction_of_profiled_window'] == pytest.approx(80 / 200)
    assert summary['busy_fraction_of_timed_step'] == pytest.approx(0.04 / 0.1)
    first, second = summary['top_kernels']
    assert first == {'name': kernel, 'calls_per_step': 1, 'ms_per_step': 0.03, 'share': 60 / 80}
    assert second['name'] == 'elementwise_add' and second['share'] == pytest.approx(20 / 80)
    assert summary['sdpa_ops'] == ['aten::_scaled_dot_product_flash_attention'] and summary['sdpa_kernels'] == [kernel]
    with pytest.raises(ValueError, match='steps must be at least 1'):
        summarize(events, steps=0)


# Kernel names from the H200 profiles in results/benchmarks, shortened, and what kind each is.
_KERNEL_NAMES = {
    '_ZN17cutlass__5x_cudnn6KernelINS_4conv6kernel23ImplicitGemmConvolutionINS1_11threadblock': 'convolution',
    'dgrad2d_c1_k1_nhwc_specialized': 'convolution',
    'void at::native::(anonymous namespace)::conv_depthwise2d_grad_weight_kernel<c10::BFloat16, unsigned int>':
        'convolution',
    'depthwise_weight_grad': 'convolution',  # lipsformer::depthwise_conv2d's Triton kernels
    'fmha_cutlassB_bf16_aligned_64x64_k32_sm80(PyTorchMemEffAttention::AttentionBackwardKernel': 'attention',
    'nvjet_sm90_tst_192x192_64x4_2x1_v_bz_coopB_bias_TNN': 'matmul',
    'void cutlass::Kernel2<cutlass_75_wmma_tensorop_bf16_s161616gemm_bf16_32x32_32x1_nn_align1>': 'matmul',
    'triton_red_fused__to_copy_add_native_layer_norm_0': 'inductor fused',
    'void at::native::elementwise_kernel<128, 2, at::native::gpu_kernel_impl_nocast<at::native::direct_copy_kernel':
        'copy',
    'void at::native::(anonymous namespace)::CatArrayBatchedCopy<at::native::(anonymous namespace)::OpaqueType<2u>':
        'copy',
    'void at::native::vectorized_elementwise_kernel<8, at::native::GeluCUDAKernelImpl': 'other',
    'Optimizer.step#AdamW.step': 'annotation',
}


def test_kernels_are_grouped_by_kind_and_their_times_add_up():
    assert {name: kernel_kind(name) for name in _KERNEL_NAMES} == _KERNEL_NAMES
    events = [TimedEvent(name, 10 * i, 10 * i + i + 1, True) for i, name in enumerate(_KERNEL_NAMES)]
    by_kind = summarize(events, steps=1)['ms_per_step_by_kind']
    assert sum(by_kind.values()) == pytest.approx(sum(event.end_us - event.start_us for event in events) / 1e3)
    assert by_kind['matmul'] == pytest.approx((6 + 7) / 1e3)


def test_profile_steps_on_the_cpu_sees_the_attention_op():
    query = torch.randn(2, 2, 8, 16)
    summary = profile_steps(lambda: F.scaled_dot_product_attention(query, query, query), steps=2)
    assert summary['steps'] == 2 and summary['kernels_per_step'] == 0  # no device, no kernels
    assert summary['sdpa_ops'] == ['aten::_scaled_dot_product_flash_attention_for_cpu']
    assert summary['profiled_window_ms_per_step'] > 0 and summary['busy_fraction_of_timed_step'] is None


def test_guard_runs_a_step_only_where_it_fits():
    assert guard(100, elapsed_s=0, budget_s=200, reserve_s=10) == (True, 190)
    assert guard(100, elapsed_s=95, budget_s=200, reserve_s=10) == (False, 95)
    assert guard(10, elapsed_s=250, budget_s=200, reserve_s=10) == (False, 0)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def test_run_steps_records_failures_and_skips_what_would_not_fit(tmp_path):
    """Steps take their estimated time on a fake clock: the failing one is recorded and the next runs; a step whose
    estimate exceeds what is left is skipped; a step runs under all that is left when that is under its limit."""
    clock, calls = FakeClock(), []
    (tmp_path / 'ok.json').write_text('{"results": []}')

    def runner(argv, timeout_s, log):
        calls.append((argv[0], timeout_s))
        clock.now += {'ok': 50, 'fails': 30, 'slow': 200, 'late': 10}[argv[0]]
        return {'ok': (0, False, 'fine'), 'fails': (3, False, 'boom'), 'slow': (None, True, 'cut'),
                'late': (0, False, '')}[argv[0]]

    steps = [Step('first', ['ok'], 40, 100, 'eager', str(tmp_path / 'ok.json')),
             Step('second', ['fails'], 30, 100, 'pytest'),
             Step('third', ['slow'], 60, 500, 'compiled', compile_mode='default'),
             Step('fourth', ['late'], 20, 100, 'memory')]  # 10 s left of 300: 280 elapsed, 10 reserved
    reported = []
    results = run_steps(steps, budget_s=300, clock=clock, runner=runner, reserve_s=10,
                        after_step=lambda done: reported.append(len(done)))
    assert [result.status for result in results] == ['ok', 'failed', 'timed out', 'skipped']
    assert calls == [('ok', 100), ('fails', 100), ('slow', 210)]  # the third: 300 - 80 elapsed - 10 reserved
    assert results[0].data == {'results': []} and results[1].note == 'exit status 3'
    assert results[2].note == 'stopped at its limit of 210 s' and results[2].compile_mode == 'default'
    assert 'time guard' in results[3].note and results[3].seconds == 0
    assert reported == [1, 2, 3, 4]  # the report is rewritten after every step


def _benchmark_report(models, mode_speeds, **extra):
    rows = []
    for mode, speeds in mode_speeds.items():
        for model, speed in zip(models, speeds):
            rows.append({'model': model, 'mode': mode, 'images_per_s': speed, 'ratio': speed / speeds[0],
                         'ratio_median': speed / speeds[0], 'ratio_quartiles': [speed / speeds[0]] * 2,
                         'first_step_s': 30.0, 'cuda_peak_memory_mb_in_process': 9000.0,
                         'peak_memory_mb': 9000.0 + speed, 'memory_ratio': 1.0, **extra})
    return {'config': {'models': models, 'cudnn_benchmark': True}, 'results': rows}


def test_report_tables(tmp_path):
    models = [gpu_check.TIMM_SWIN, 'lipsformer_swin_tiny']
    eager = _benchmark_report(models, {'train': [2000, 1000], 'infer': [5000, 3000]}, profile={
        'kernels_per_step': 1300, 'busy_fraction_of_timed_step': 0.9, 'sdpa_ops': ['aten::_efficient_attention'],
        'sdpa_kernels': ['fmha_cutlassF'], 'top_kernels': [{'name': 'sm90_gemm', 'calls_per_step': 50,
                                                            'ms_per_step': 12.5, 'share': 0.4}]})
    results = [
        StepResult('environment', 'environment', 'ok', 3, 0, data={'gpu': 'NVIDIA H100 80GB HBM3', 'torch': '2.11'}),
        StepResult('eager benchmark', 'eager', 'ok', 100, 0, data=eager),
        StepResult('tests/test_cuda.py, without compilation', 'pytest', 'failed', 90, 1, 'exit status 1',
                   '...\n1 failed, 7 passed in 80s\n'),
        StepResult('compiled lipsformer_swin_tiny (reduce-overhead)', 'compiled', 'ok', 100, 0,
                   data=_benchmark_report(['lipsformer_swin_tiny'], {'train': [2700]}),
                   compile_mode='reduce-overhead'),
        StepResult(f'compiled {gpu_check.TIMM_SWIN} (default)', 'compiled', 'ok', 100, 0,
                   data=_benchmark_report([gpu_check.TIMM_SWIN], {'train': [3000], 'infer': [9000]}),
                   compile_mode='default'),
        StepResult('compiled lipsformer_swin_tiny (default)', 'compiled', 'ok', 100, 0,
                   data=_benchmark_report(['lipsformer_swin_tiny'], {'train': [2400], 'infer': [6000]}),
                   compile_mode='default'),
        StepResult(f'compiled {gpu_check.TIMM_SWIN} (reduce-overhead)', 'compiled', 'ok', 100, 0,
                   data=_benchmark_report([gpu_check.TIMM_SWIN], {'train': [3600]}),
                   compile_mode='reduce-overhead'),
        StepResult('compiled lipsformer_cswin_tiny (reduce-overhead)', 'compiled', 'skipped',
                   note='skipped by the time guard', compile_mode='reduce-overhead'),
    ]
    md_path, json_path = write_gpu_report(results, tmp_path, budget_s=540, elapsed_s=480)
    md = md_path.read_text()
    assert 'NVIDIA H100 80GB HBM3' in md and '480 s of a 540 s budget' in md
    assert '| tests/test_cuda.py, without compilation | failed | 90 | exit status 1 |' in md
    assert 'tests/test_cuda.py, without compilation: 1 failed, 7 passed in 80s' in md
    assert ('| `lipsformer_swin_tiny` | 1000: 0.50x (0.50, 0.50-0.50) | 3000: 0.60x (0.60, 0.60-0.60) | 1300, 0.90 |'
            in md)
    assert '| `sm90_gemm` | 50.0 | 12.500 | 40.0% |' in md
    # Compiled: ratios to timm's Swin-T compiled in the same mode, and to the same model eager.
    assert '| `lipsformer_swin_tiny` | default | train | 30.0 | 2400: 0.80x | 2.40x | 9000 |' in md
    assert '| `lipsformer_swin_tiny` | default | infer | 30.0 | 6000: 0.67x | 2.00x | 9000 |' in md
    # a row run before its reference has its ratio too; a run without inference has a training row alone
    assert '| `lipsformer_swin_tiny` | reduce-overhead | train | 30.0 | 2700: 0.75x | 2.70x | 9000 |' in md
    assert '| `lipsformer_swin_tiny` | reduce-overhead | infer |' not in md
    assert '| `lipsformer_cswin_tiny` | reduce-overhead | - | skipped by the time guard |' in md
    saved = json.loads(json_path.read_text())
    assert saved['eager'] == eager and len(saved['compiled']) == 5 and saved['compiled'][4] is None
    assert [step['status'] for step in saved['steps']] == ['ok', 'ok', 'failed', 'ok', 'ok', 'ok', 'ok', 'skipped']


def test_the_plan_covers_the_issue_s_models_and_modes(tmp_path):
    steps = {step.name: step for step in plan_steps(tmp_path)}
    eager = steps['eager benchmark'].argv
    assert [spec.text for spec in parse_model_specs(eager[eager.index('--models') + 1])] == gpu_check.EAGER_MODELS
    assert ['--batch-size', '128'] == eager[eager.index('--batch-size'):][:2] and '--profile' in eager
    compiled = [step for step in steps.values() if step.kind == 'compiled']
    assert [(step.argv[step.argv.index('--models') + 1], step.compile_mode) for step in compiled] == [
        (model, mode) for model, mode, _ in gpu_check.COMPILED + gpu_check.COMPILED_ANCHOR]
    assert len({step.json_path for step in compiled}) == len(compiled)
    assert all(step.argv[step.argv.index('--mode') + 1] == 'train' for step in compiled)
    assert '--compile-mode' in steps['compiled lipsformer_cswin_tiny (reduce-overhead)'].argv
    # the three models the targets compare, in both modes; the default mode first
    targets = {gpu_check.TIMM_SWIN, 'lipsformer_swin_tiny', 'lipsformer_cswin_tiny'}
    for mode in ('default', 'reduce-overhead'):
        assert {model for model, entry_mode, _ in gpu_check.COMPILED if entry_mode == mode} >= targets
    assert [mode for _, mode, _ in gpu_check.COMPILED][:3] == ['default'] * 3


def _models(step: Step) -> list[str]:
    return [spec.text for spec in parse_model_specs(step.argv[step.argv.index('--models') + 1])]


def test_timm_s_convnext_stands_beside_swin_in_every_model_list_with_swin_the_reference(tmp_path):
    """ConvNeXt-T, fast and built on cuDNN's depthwise 7x7 convolutions, is second wherever timm's Swin-T is first:
    the eager, autotuning and memory steps; it is compiled in both modes after the runs the targets compare."""
    convnext = gpu_check.TIMM_CONVNEXT
    assert convnext.startswith('convnext_tiny[')
    steps = plan_steps(tmp_path)
    for step in steps:
        if step.kind in ('eager', 'cudnn', 'memory'):
            assert _models(step)[:2] == [gpu_check.TIMM_SWIN, convnext], step.name
    compiled = [(_models(step)[0], step.compile_mode) for step in steps if step.kind == 'compiled']
    assert compiled[-2:] == [(convnext, 'default'), (convnext, 'reduce-overhead')]


def test_the_plan_times_training_with_cudnn_autotuning_on_and_off(tmp_path):
    """Every step autotunes unless the driver is told not to; one process (cuDNN keeps a shape's pick for the rest of a
    process) trains the anchors and both tiny models with it off, with the eager step's settings, for the eager
    step's autotuned training rows to be compared with."""
    steps = plan_steps(tmp_path)
    (eager,) = [step for step in steps if step.kind == 'eager']
    (off,) = [step for step in steps if step.kind == 'cudnn']
    assert _models(off) == gpu_check.CUDNN_MODELS == _models(eager)[:len(gpu_check.CUDNN_MODELS)]
    assert {'lipsformer_swin_tiny', 'lipsformer_cswin_tiny', gpu_check.TIMM_CONVNEXT} <= set(_models(off))
    assert off.argv[off.argv.index('--mode') + 1] == 'train' and '--profile' not in off.argv
    assert '--no-cudnn-benchmark' in off.argv

    def timing(step: Step) -> list[str]:
        return [step.argv[step.argv.index(option) + 1] for option in ('--warmup', '--repeats', '--steps',
                                                                      '--batch-size', '--precision', '--img-size')]

    assert timing(off) == timing(eager)
    measured = [step for step in steps if step.kind in ('ops', 'eager', 'compiled', 'memory')]
    assert measured and not any('cudnn-benchmark' in ' '.join(step.argv) for step in measured)
    without = plan_steps(tmp_path, cudnn_benchmark=False)
    assert all('--no-cudnn-benchmark' in step.argv for step in without
               if step.kind in ('ops', 'eager', 'compiled', 'memory'))
    assert not [step for step in without if step.kind == 'cudnn']  # nothing autotuned to compare with
    assert [step.kind for step in plan_steps(tmp_path, kinds={'cudnn'})] == ['cudnn']


def test_the_report_compares_training_with_cudnn_autotuning_on_and_off(tmp_path):
    models = [gpu_check.TIMM_SWIN, gpu_check.TIMM_CONVNEXT, 'lipsformer_cswin_tiny']
    on = _benchmark_report(models, {'train': [2000, 2500, 600]})
    off = _benchmark_report(models, {'train': [1900, 1000, 400]})
    on['config']['cudnn_benchmark'], off['config']['cudnn_benchmark'] = True, False
    for row in off['results']:
        row['first_step_s'] = 2.0
    results = [StepResult('eager benchmark', 'eager', 'ok', 40, 0, data=on),
               StepResult('eager training, cuDNN autotuning off', 'cudnn', 'ok', 50, 0, data=off)]
    md_path, json_path = write_gpu_report(results, tmp_path, budget_s=540, elapsed_s=90)
    md = md_path.read_text()
    assert '## cuDNN autotuning: eager training with it on and off, a process each' in md
    assert f'| `{gpu_check.TIMM_CONVNEXT}` | 2500: 1.25x | 1000: 0.53x | 2.50x | 30.0, 2.0 |' in md
    assert '| `lipsformer_cswin_tiny` | 600: 0.30x | 400: 0.21x | 1.50x | 30.0, 2.0 |' in md
    saved = json.loads(json_path.read_text())
    assert saved['eager'] == on and saved['cudnn_autotuning_off'] == off
    missing = write_gpu_report(results[1:], tmp_path, budget_s=540, elapsed_s=50)[0].read_text()
    assert f'| `{gpu_check.TIMM_SWIN}` | - | 1900: 1.00x | - | -, 2.0 |' in missing
    # without the run that turns it off, the eager step's rows have nothing to be compared with: no table
    alone = write_gpu_report(results[:1], tmp_path, budget_s=540, elapsed_s=40)[0].read_text()
    assert '## cuDNN autotuning' not in alone and '## Eager, interleaved in one process' in alone


def test_script_dry_run_prints_the_plan(tmp_path):
    completed = subprocess.run([str(SCRIPT), str(tmp_path / 'out'), '--dry-run'], capture_output=True, text=True,
                               env=os.environ | {'PYTHON': sys.executable}, cwd=tmp_path)
    assert completed.returncode == 0, completed.stderr
    compiled = len(gpu_check.COMPILED) + len(gpu_check.COMPILED_ANCHOR)
    assert completed.stdout.count('-m lipsformer.instruments.benchmark') == 1 + compiled + 1 + 1
    assert completed.stdout.count('-m lipsformer.instruments.gpu_check --op-benchmark') == 1
    assert 'tests/test_cuda.py' in completed.stdout


@pytest.mark.parametrize('cpu_smoke', [False, True])
def test_every_step_s_command_is_one_its_program_takes(tmp_path, cpu_smoke):
    """The options the plan passes to the benchmark and to the driver's own entries parse as those programs read
    them, so that no step fails on its command line on a GPU."""
    from lipsformer.instruments import benchmark
    parsers = {'lipsformer.instruments.benchmark': benchmark._parser(), 'lipsformer.instruments.gpu_check':
               gpu_check._parser()}
    checked = 0
    for step in plan_steps(tmp_path, cpu_smoke):
        if step.argv[1:2] == ['-m'] and step.argv[2] in parsers:
            parsers[step.argv[2]].parse_args(step.argv[3:])
            checked += 1
        else:
            tests = step.argv[step.argv.index('--durations=0') + 1]
            assert step.argv[1:4] == ['-m', 'pytest', '-v'] and (REPO / tests).is_file()
    assert checked == len(plan_steps(tmp_path, cpu_smoke)) - 2  # all but the two pytest steps


def test_script_needs_an_out_dir():
    completed = subprocess.run([str(SCRIPT), '--dry-run'], capture_output=True, text=True)
    assert completed.returncode == 2 and 'usage' in completed.stderr


def test_script_cpu_smoke_writes_its_report(tmp_path):
    """The environment, the eager benchmark (with profiles) and training with cuDNN's autotuning off, of tiny models on
    the CPU, through the script."""
    out = tmp_path / 'out'
    completed = subprocess.run([str(SCRIPT), str(out), '--cpu-smoke', '--steps', 'environment,cudnn,eager'],
                               capture_output=True, text=True, env=os.environ | {'PYTHON': sys.executable})
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    assert sorted(path.name for path in out.iterdir()) == ['gpu_check.json', 'gpu_check.log', 'gpu_check.md']
    report = json.loads((out / 'gpu_check.json').read_text())
    assert [(step['kind'], step['status']) for step in report['steps']] == [
        ('environment', 'ok'), ('eager', 'ok'), ('cudnn', 'ok')]
    assert report['environment']['torch'] == torch.__version__ and report['cpu_smoke']
    assert {row['model'] for row in report['eager']['results']} == set(gpu_check.SMOKE_MODELS)
    assert all(row['profile']['steps'] == 1 for row in report['eager']['results'])
    assert report['eager']['config']['cudnn_benchmark'] is True
    off = report['cudnn_autotuning_off']
    assert off['config']['cudnn_benchmark'] is False
    assert [row['model'] for row in off['results']] == gpu_check.SMOKE_CUDNN_MODELS
    markdown = (out / 'gpu_check.md').read_text()
    assert '## Eager, interleaved in one process' in markdown and '## cuDNN autotuning' in markdown


@pytest.mark.slow
def test_script_cpu_smoke_every_step(tmp_path):
    """Every step on the CPU; inductor's compilation does not fit the budget and is skipped by the time guard."""
    out = tmp_path / 'out'
    completed = subprocess.run([str(SCRIPT), str(out), '--cpu-smoke', '--budget', '400'], capture_output=True,
                               text=True, env=os.environ | {'PYTHON': sys.executable})
    assert completed.returncode == 0, completed.stdout[-3000:]
    report = json.loads((out / 'gpu_check.json').read_text())
    assert [(step['kind'], step['status']) for step in report['steps']] == [
        ('environment', 'ok'), ('eager', 'ok'), ('compiled', 'skipped'), ('cudnn', 'ok'), ('ops', 'ok'),
        ('memory', 'ok'), ('pytest', 'ok'), ('pytest', 'skipped')]
    assert report['peak_memory']['results'][0]['peak_memory_mb'] > 0
    assert report['l2_normalize']['rows']
    markdown = (out / 'gpu_check.md').read_text()
    assert '## q/k normalisation: lipsformer::l2_normalize against PyTorch' in markdown


def test_the_cuda_tests_split_into_those_that_compile_and_the_rest(tmp_path):
    """The two pytest steps select every test of tests/test_cuda.py once, and the second holds those that compile."""
    steps = [step for step in plan_steps(tmp_path) if step.kind == 'pytest']
    assert [step.name for step in steps] == ['tests/test_cuda.py, without compilation', 'tests/test_cuda.py, compiled']
    selected = []
    for step in steps:
        argv = [sys.executable, '-m', 'pytest', '--collect-only', '-q', '-p', 'no:cacheprovider', '-m', '',
                *step.argv[step.argv.index('tests/test_cuda.py'):]]
        completed = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
        assert completed.returncode == 0, completed.stdout[-2000:] + completed.stderr[-2000:]
        selected.append({line.split('::')[1].split('[')[0] for line in completed.stdout.splitlines() if '::' in line})
    everything = set(re.findall(r'^def (test_\w+)', (REPO / 'tests' / 'test_cuda.py').read_text(), re.MULTILINE))
    assert selected[0] | selected[1] == everything and not selected[0] & selected[1]
    assert {'test_torch_compile_equals_eager', 'test_torch_compile_of_a_fast_form_equals_the_eager_plain_model',
            'test_twenty_training_steps_lower_the_loss',
            'test_cuda_graphs_runs_stop_and_resume_in_either_compile_scope',
            'test_cuda_graphs_run_stopped_by_ctrl_c_mid_epoch_resumes_auto',
            'test_cuda_graphs_train_with_accumulation_clipping_constraint_and_ema_as_eager'} == selected[1]
    order = [step.kind for step in plan_steps(tmp_path)]
    assert order == ['environment', 'eager', *['compiled'] * len(gpu_check.COMPILED), 'cudnn',
                     *['compiled'] * len(gpu_check.COMPILED_ANCHOR), 'ops', 'memory', 'pytest', 'pytest']


def test_the_default_budget_measures_what_the_gpu_targets_compare(tmp_path):
    """Steps that take their estimates: the default budget runs the eager benchmark and the training of
    LipsFormer-Swin-T, -CSwin-T and timm's Swin-T compiled in both modes, and skips what does not fit (a second run
    takes it: ``--steps cudnn,ops,memory,pytest``)."""
    steps = plan_steps(tmp_path)
    now = [0.0]

    def runner(argv, timeout_s, log):
        now[0] += next(step.estimate_s for step in steps if step.argv == argv)
        return 0, False, ''

    results = run_steps(steps, gpu_check.DEFAULT_BUDGET_S, clock=lambda: now[0], runner=runner)
    ran = [result.name for result in results if result.status == 'ok']
    targets = [gpu_check.TIMM_SWIN, 'lipsformer_swin_tiny', 'lipsformer_cswin_tiny']
    assert ran[:2] == ['environment', 'eager benchmark']
    assert sorted(ran[2:]) == sorted(f'compiled {model} ({mode})' for model in targets
                                     for mode in ('default', 'reduce-overhead'))
    skipped = [result.name for result in results if result.status == 'skipped']
    assert len(skipped) == len(steps) - len(ran)
    assert now[0] <= gpu_check.DEFAULT_BUDGET_S - gpu_check.RESERVE_S


def test_script_a_driver_that_ends_before_its_report_leaves_its_error_in_the_report(tmp_path):
    """A bad option ends the driver before it writes anything: gpu_check.md says so with the driver's error output,
    and names only files that exist."""
    out = tmp_path / 'out'
    completed = subprocess.run([str(SCRIPT), str(out), '--bogus'], capture_output=True, text=True,
                               env=os.environ | {'PYTHON': sys.executable})
    assert completed.returncode == 2 and 'unrecognized arguments: --bogus' in completed.stderr
    report = (out / 'gpu_check.md').read_text()
    assert report.startswith('gpu_check: the driver ended with status 2 before writing its report.\n')
    assert report.rstrip().endswith('error: unrecognized arguments: --bogus')
    assert sorted(path.name for path in out.iterdir()) == ['gpu_check.md']
    assert all(Path(path).exists() for path in re.findall(r'(/\S+)', report) if path.startswith(str(tmp_path)))
    assert 'gpu_check.log' not in report


def test_script_header_states_the_drivers_time_limits():
    """The header said 540 s where the driver's default was 570, and the script killed the driver at 590 s of its own
    whatever --budget said: the numbers it states are the driver's, and it sets none."""
    text = SCRIPT.read_text()
    header = ''.join(line for line in text.splitlines(keepends=True) if line.startswith('#'))
    (budget,) = re.findall(r'\((\d+) s by default\)', header)
    (margin,) = re.findall(r'ends itself (\d+) s after its budget', header)
    assert (int(budget), int(margin)) == (gpu_check.DEFAULT_BUDGET_S, gpu_check.HARD_LIMIT_MARGIN_S)
    code = ''.join(line for line in text.splitlines(keepends=True) if not line.lstrip().startswith('#'))
    assert 'timeout' not in code and not re.search(r'\b(5\d\d|6\d\d)\b', code)


def test_the_driver_ends_itself_a_margin_after_the_budget_it_is_given(tmp_path, monkeypatch):
    alarms = []
    monkeypatch.setattr(gpu_check.signal, 'alarm', alarms.append)
    monkeypatch.setattr(gpu_check, 'run_steps', lambda steps, budget_s, log, after_step: [])
    assert gpu_check.main(['--out', str(tmp_path), '--budget', '1000.5', '--steps', 'environment']) == 0
    assert alarms == [1001 + gpu_check.HARD_LIMIT_MARGIN_S, 0]  # armed for the steps, disarmed after the report
    assert f'ends {gpu_check.HARD_LIMIT_MARGIN_S} s after it' in gpu_check._parser().format_help().replace('\n', ' ')


def _fake_driver(tmp_path: Path, body: str) -> dict[str, str]:
    """The environment that runs ``body`` (shell, $4 the report folder) as the script's Python."""
    fake = tmp_path / 'fake_python'
    fake.write_text(f'#!/usr/bin/env bash\n{body}\n')
    fake.chmod(0o755)
    return os.environ | {'PYTHON': str(fake)}


def test_script_says_when_the_driver_ended_itself_at_its_limit(tmp_path):
    out = tmp_path / 'out'
    env = _fake_driver(tmp_path, 'echo "# GPU check" > "$4/gpu_check.md"; kill -ALRM $$')
    completed = subprocess.run([str(SCRIPT), str(out)], capture_output=True, text=True, env=env)
    assert completed.returncode == 142
    report = (out / 'gpu_check.md').read_text().splitlines()
    assert report[0] == '# GPU check' and report[1].startswith('gpu_check: the driver overran its budget and ended')
    assert 'overran its budget' in completed.stderr


def test_script_leaves_an_earlier_report_and_says_it_is_not_this_run_s(tmp_path):
    """A bad option in a second run into the same folder: the first run's report is neither lost nor taken for this
    run's."""
    out = tmp_path / 'out'
    out.mkdir()
    (out / 'gpu_check.md').write_text('# GPU check\nthe earlier run\n')
    completed = subprocess.run([str(SCRIPT), str(out), '--bogus'], capture_output=True, text=True,
                               env=os.environ | {'PYTHON': sys.executable})
    assert completed.returncode == 2
    assert (out / 'gpu_check.md').read_text() == '# GPU check\nthe earlier run\n'
    assert f"before writing its report; {out / 'gpu_check.md'} is an earlier run's, left as it was" in completed.stderr


@pytest.mark.parametrize('name', gpu_check.OP_MODELS)
def test_the_l2_step_reads_q_and_k_of_every_block_laid_out_as_the_projection(name):
    """Two calls a block (q and k); in Swin-T's first stage each window's q is a (heads, tokens, head dim) view of the
    qkv projection, whose tokens are 3 x 96 values apart."""
    import timm
    blocks = sum(len(stage.blocks) for stage in timm.create_model(name, device='meta').stages)
    inputs = gpu_check.l2_normalize_inputs(name, batch=2)
    assert sum(entry['calls'] for entry in inputs) == 2 * blocks
    if name == 'lipsformer_swin_tiny':
        assert inputs[0] == {'shape': [2 * 64, 3, 49, 32], 'strides': [49 * 288, 32, 288, 1], 'calls': 4}


def test_the_l2_benchmark_times_both_passes_against_pytorch_with_their_errors_to_float64():
    report = gpu_check.l2_normalize_benchmark(batch=1, device='cpu', precision='fp32', repeats=1,
                                              models=('lipsformer_swin_tiny',))
    inputs = gpu_check.l2_normalize_inputs('lipsformer_swin_tiny', batch=1)
    assert [(row['shape'], row['pass']) for row in report['rows']] == [
        (entry['shape'], pass_name) for entry in inputs for pass_name in ('forward', 'backward')]
    for row in report['rows']:
        assert row['op_relative_error'] < 1e-6 and row['plain_relative_error'] < 1e-6
        assert row['bytes'] == (2 if row['pass'] == 'forward' else 3) * 4 * math.prod(row['shape'])
        assert row['speedup'] == row['plain_ms'] / row['op_ms']
    table = gpu_check._l2_table(report)
    assert table.count('| `lipsformer_swin_tiny` |') == len(report['rows'])
