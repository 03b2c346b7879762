"""The GPU check in one command, sized to end within 9 minutes on a GPU: ``scripts/gpu_check.sh OUT_DIR``.

Steps, in order of what matters most, each a subprocess under its own time limit (``timeout``), each failure recorded
while the check goes on, and a time guard that skips a step whose usual duration would not fit in what is left of
the budget (and says so in the report), while smaller steps after it still run:

1. the environment: GPU, driver, torch, CUDA, cuDNN, timm, Python;
2. the eager benchmark, with cuDNN's autotuning on as timm's scripts set it: timm's Swin-T and ConvNeXt-T, both tiny
   LipsFormer models in CUDA's default form, and CSwin-T with each weight cast at its use, bf16 autocast, batch 128,
   224x224, training and inference, interleaved in one process, with a ``torch.profiler`` summary of each model and
   mode (``python -m lipsformer.instruments.benchmark --profile``);
3. training compiled (:data:`COMPILED`), a process each, LipsFormer-CSwin-T and -Swin-T regionally (the benchmark's
   default scope) and timm's Swin-T: in the default mode, then with ``mode='reduce-overhead'`` (CUDA graphs); the
   first step (compilation included), images/s, peak memory, profiled;
4. eager training of :data:`CUDNN_MODELS` with cuDNN's autotuning off, in a process of its own (cuDNN keeps the
   kernel it picked for a shape for the rest of a process): against step 2's training rows, what autotuning gains
   on the depthwise 7x7 convolutions, and what its first step costs; then timm's ConvNeXt-T's training compiled in
   both modes (:data:`COMPILED_ANCHOR`);
5. the custom op against the stock kernels it stands for: ``lipsformer::l2_normalize`` forward and backward against
   ``F.normalize`` and its autograd backward on the q and k layouts of both tiny models' fast forms (bf16, batch 128,
   :func:`l2_normalize_benchmark`);
6. the peak memory of an eager training step of :data:`CUDNN_MODELS`, each in a fresh process;
7. ``python -m pytest tests/test_cuda.py``: the tests that compile nothing, then those that compile.

It writes ``gpu_check.md`` (tables), ``gpu_check.json`` (everything, the benchmark reports included) and
``gpu_check.log`` (every step's output) into the folder it is given, after every step, so that a check cut short
still leaves its report. ``--cpu-smoke`` runs the same steps with tiny models on the CPU; ``--dry-run`` prints the
plan. The budget (``--budget``, :data:`DEFAULT_BUDGET_S` by default) bounds the steps; the driver itself ends
:data:`HARD_LIMIT_MARGIN_S` after it whatever it is doing (``SIGALRM``), should it ever hang. Every step but the
fourth runs with cuDNN's autotuning on, as timm's scripts do (``--no-cudnn-benchmark``: off, and then the fourth step
is left out, having nothing to compare with). Within the default budget, by the estimates, that is steps 1 to 3.

timm's Swin-T is the reference every ratio is to; timm's ConvNeXt-T beside it is a fast model that runs cuDNN's
depthwise 7x7 convolutions too, so that every table shows what they cost where little else does.
"""

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ['Step', 'StepResult', 'environment_facts', 'guard', 'l2_normalize_benchmark', 'l2_normalize_inputs',
           'main', 'plan_steps', 'run_steps', 'write_gpu_report']

# timm's models as timm's train.py trains them: autocast casting each weight at its use (the package's training step
# casts them together, lipsformer.training.weight_casts), the LipsFormer models' own default drop path. ConvNeXt-T is
# the anchor with depthwise 7x7 convolutions.
TIMM_SWIN = 'swin_tiny_patch4_window7_224[drop_path_rate=0.2,grouped_weight_casts=False]'
TIMM_CONVNEXT = 'convnext_tiny[drop_path_rate=0.2,grouped_weight_casts=False]'
# The models trained with cuDNN's autotuning on (the eager step) and off: the anchors and both tiny models in CUDA's
# default form.
CUDNN_MODELS = [TIMM_SWIN, TIMM_CONVNEXT, 'lipsformer_swin_tiny', 'lipsformer_cswin_tiny']
# And CSwin-T with each weight cast at its use, for what grouping the casts gains.
EAGER_MODELS = [*CUDNN_MODELS, 'lipsformer_cswin_tiny[grouped_weight_casts=False]']
# The tiny models whose q/k normalisations the ops step times.
OP_MODELS = ('lipsformer_swin_tiny', 'lipsformer_cswin_tiny')
# (model, torch.compile mode, seconds on an H200 with margin: compiling the training graph takes most) for the
# training steps compiled, in order of need: the models the targets compare, the default mode first, cold (the
# reduce-overhead runs after it find the kernels it compiled in inductor's cache, so their first step is not a cold
# compile); the ConvNeXt-T anchor's come after the run without autotuning.
COMPILED = [('lipsformer_cswin_tiny', 'default', 80), (TIMM_SWIN, 'default', 70),
            ('lipsformer_swin_tiny', 'default', 70), ('lipsformer_cswin_tiny', 'reduce-overhead', 40),
            (TIMM_SWIN, 'reduce-overhead', 35), ('lipsformer_swin_tiny', 'reduce-overhead', 35)]
COMPILED_ANCHOR = [(TIMM_CONVNEXT, 'default', 70), (TIMM_CONVNEXT, 'reduce-overhead', 35)]
MEMORY_MODELS = CUDNN_MODELS
# tests/test_cuda.py's tests that compile (pytest -k): they come last, after the compiled benchmarks.
CUDA_TESTS_THAT_COMPILE = 'compile or twenty or cuda_graphs'
KINDS = ('environment', 'eager', 'compiled', 'cudnn', 'ops', 'memory', 'pytest')
DEFAULT_BUDGET_S = 510  # with the driver's margin, a check of at most 9 minutes
RESERVE_S = 15  # kept for writing the report
# The driver ends this long after its budget whatever it is doing: its steps end by then (each under the time left,
# plus timeout's 10 s to kill), so only a hang of the driver itself meets it. The default check ends within 9 minutes.
HARD_LIMIT_MARGIN_S = 30
# Tiny shapes for --cpu-smoke: every step's code path in seconds on a CPU.
SMOKE_SWIN = 'embed_dim=16,depths=[1,1,1,1],num_heads=[1,1,1,1],window_size=4,img_size=32'
SMOKE_CSWIN = 'embed_dim=16,depths=[1,1,1,1],num_heads=[2,2,4,4],split_size=[1,2,2,2],img_size=32'
SMOKE_MODELS = ['test_vit[img_size=32]', f'lipsformer_swin_tiny[{SMOKE_SWIN},fast_path=True]',
                f'lipsformer_cswin_tiny[{SMOKE_CSWIN},fast_path=True]',
                f'lipsformer_swin_tiny[{SMOKE_SWIN},fast_path=False]']
SMOKE_CUDNN_MODELS = SMOKE_MODELS[:3]


@dataclasses.dataclass
class Step:
    """One step of the check: a command, its usual duration (for the time guard) and its time limit."""

    name: str
    argv: list[str]
    estimate_s: float
    timeout_s: float
    kind: str  # one of KINDS: how the report reads its output
    json_path: str | None = None  # the JSON file the command writes, merged into the report
    compile_mode: str | None = None


@dataclasses.dataclass
class StepResult:
    """What became of a step: ok, failed, timed out or skipped, with why, its time and its output's tail."""

    name: str
    kind: str
    status: str
    seconds: float = 0.0
    returncode: int | None = None
    note: str = ''
    output_tail: str = ''
    data: Any = None
    compile_mode: str | None = None


def guard(estimate_s: float, elapsed_s: float, budget_s: float, reserve_s: float = RESERVE_S) -> tuple[bool, float]:
    """Whether a step that usually takes ``estimate_s`` fits in what is left of the budget, and the time limit it
    then runs under (all that is left, so that a slow run is cut at the budget, not the check)."""
    left = budget_s - elapsed_s - reserve_s
    return estimate_s <= left, max(left, 0.0)


def _python() -> str:
    return sys.executable or 'python3'


def plan_steps(work_dir: Path, cpu_smoke: bool = False, kinds: set[str] | None = None,
               cudnn_benchmark: bool = True) -> list[Step]:
    """The check's steps (those of ``kinds``, default all of :data:`KINDS`), their benchmark reports written into
    ``work_dir``; ``cudnn_benchmark`` False runs every step without cuDNN's autotuning and leaves out the run that
    turns it off."""
    python = _python()
    if cpu_smoke:
        common = ['--batch-size', '2', '--img-size', '32', '--precision', 'fp32', '--device', 'cpu', '--threads', '1']
        timed = {'eager': ['--warmup', '1', '--repeats', '2', '--steps', '1'],
                 'compiled': ['--warmup', '1', '--repeats', '1', '--steps', '1'],
                 'cudnn': ['--warmup', '1', '--repeats', '1', '--steps', '1']}
        # Inductor's compilation on a CPU takes minutes: the time guard skips it unless the budget is generous.
        eager_models, memory_models = SMOKE_MODELS, SMOKE_MODELS[:1]
        compiled, compiled_anchor = [(SMOKE_MODELS[1], 'default', 900)], []
        cudnn_models = SMOKE_CUDNN_MODELS
        estimates = {'environment': 20, 'eager': 60, 'cudnn': 30, 'ops': 60, 'pytest': 30, 'pytest_compiled': 900,
                     'memory': 60}
        profile = '1'
        ops = ['--batch-size', '1', '--device', 'cpu', '--precision', 'fp32', '--repeats', '1']
    else:
        common = ['--batch-size', '128', '--img-size', '224', '--precision', 'bf16', '--device', 'cuda']
        timed = {'eager': ['--warmup', '3', '--repeats', '3', '--steps', '5'],
                 'compiled': ['--warmup', '2', '--repeats', '3', '--steps', '5'],
                 'cudnn': ['--warmup', '3', '--repeats', '3', '--steps', '5']}
        eager_models, memory_models, cudnn_models = EAGER_MODELS, MEMORY_MODELS, CUDNN_MODELS
        compiled, compiled_anchor = COMPILED, COMPILED_ANCHOR
        # Seconds on an H200, with margin (docs/performance.md gives the durations measured): the eager step is
        # 5 models x 2 modes x (3 + 3 x 5) steps and 3 profiled steps each (5 models at 5 + 5 x 5 steps took 140 s);
        # the run without autotuning is 4 models x (3 + 3 x 5) training steps after the process's start.
        estimates = {'environment': 20, 'eager': 120, 'cudnn': 75, 'ops': 45, 'pytest': 240, 'pytest_compiled': 240,
                     'memory': 120}
        profile = '3'
        ops = ['--batch-size', '128', '--device', 'cuda', '--precision', 'bf16', '--repeats', '20']
    benchmark = [python, '-m', 'lipsformer.instruments.benchmark']
    autotuning = [] if cudnn_benchmark else ['--no-cudnn-benchmark']  # the steps' setting, as the driver is given
    # -v names each test as it ends, so that the log of a step cut at its limit says which test was running
    pytest = [python, '-m', 'pytest', '-v', '-p', 'no:cacheprovider', '--durations=0', 'tests/test_cuda.py']
    steps = [
        Step('environment',
             [python, '-m', 'lipsformer.instruments.gpu_check', '--environment', str(work_dir / 'environment.json')],
             estimates['environment'], 60, 'environment', str(work_dir / 'environment.json')),
        Step('eager benchmark', [*benchmark, '--models', ','.join(eager_models), '--mode', 'infer,train', *common,
                                 *timed['eager'], *autotuning,
                                 '--no-memory', '--profile', profile, '--json', str(work_dir / 'eager.json')],
             estimates['eager'], 300, 'eager', str(work_dir / 'eager.json')),
    ]

    def compiled_step(index: int, model: str, mode: str, estimate_s: float) -> Step:
        path = str(work_dir / f'compiled_{index}.json')
        return Step(f'compiled {model} ({mode})',
                    [*benchmark, '--models', model, '--mode', 'train', *common, *timed['compiled'], *autotuning,
                     '--compile', *([] if mode == 'default' else ['--compile-mode', mode]), '--no-memory',
                     '--profile', profile, '--json', path],
                    estimate_s, max(300, estimate_s + 60), 'compiled', path, mode)

    steps += [compiled_step(index, *entry) for index, entry in enumerate(compiled)]
    if cudnn_benchmark:  # the eager step's training rows are the autotuned ones this run is compared with
        steps.append(Step('eager training, cuDNN autotuning off',
                          [*benchmark, '--models', ','.join(cudnn_models), '--mode', 'train', *common,
                           *timed['cudnn'], '--no-cudnn-benchmark', '--no-memory',
                           '--json', str(work_dir / 'cudnn_off.json')],
                          estimates['cudnn'], 180, 'cudnn', str(work_dir / 'cudnn_off.json')))
    steps += [compiled_step(len(compiled) + index, *entry) for index, entry in enumerate(compiled_anchor)]
    steps.append(Step('custom op against stock kernels',
                      [python, '-m', 'lipsformer.instruments.gpu_check', '--op-benchmark', str(work_dir / 'ops.json'),
                       *ops, *autotuning],
                      estimates['ops'], 180, 'ops', str(work_dir / 'ops.json')))
    steps.append(Step('peak memory (eager training, fresh process each)',
                      [*benchmark, '--models', ','.join(memory_models), '--mode', 'train', *common, '--warmup', '2',
                       '--repeats', '1', '--steps', '1', *autotuning, '--json', str(work_dir / 'memory.json')],
                      estimates['memory'], 180, 'memory', str(work_dir / 'memory.json')))
    steps.append(Step('tests/test_cuda.py, without compilation', [*pytest, '-k', f'not ({CUDA_TESTS_THAT_COMPILE})'],
                      estimates['pytest'], 300, 'pytest'))
    steps.append(Step('tests/test_cuda.py, compiled', [*pytest, '-k', CUDA_TESTS_THAT_COMPILE],
                      estimates['pytest_compiled'], 300, 'pytest'))
    return [step for step in steps if kinds is None or step.kind in kinds]


def _tail(text: str, chars: int = 3000) -> str:
    return text[-chars:]


def _run_command(argv: list[str], timeout_s: float, log: Callable[[str], None]) -> tuple[int | None, bool, str]:
    """Run ``argv`` under ``timeout`` (coreutils, where present) and a backstop of Python's own, in its own process
    group so that a step's children end with it. Returns (return code, timed out, output)."""
    command = argv
    if shutil.which('timeout'):
        command = ['timeout', '-k', '10', f'{max(int(timeout_s), 1)}', *argv]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True)
    try:
        output, _ = process.communicate(timeout=timeout_s + 20)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        output, _ = process.communicate()
        log(output)
        return None, True, output
    log(output)
    # coreutils timeout exits 124 when it stopped the command, 137 when it had to kill it
    return process.returncode, process.returncode in (124, 137), output


def run_steps(steps: list[Step], budget_s: float, log: Callable[[str], None] = lambda text: None,
              clock: Callable[[], float] = time.monotonic, after_step: Callable[[list[StepResult]], None] = None,
              runner: Callable[[list[str], float, Callable[[str], None]], tuple[int | None, bool, str]] = _run_command,
              reserve_s: float = RESERVE_S) -> list[StepResult]:
    """Run the steps in order under the time guard; a failed step is recorded and the next one runs."""
    begin = clock()
    results: list[StepResult] = []
    for step in steps:
        elapsed = clock() - begin
        fits, left = guard(step.estimate_s, elapsed, budget_s, reserve_s)
        if not fits:
            results.append(StepResult(step.name, step.kind, 'skipped', note=(
                f'skipped by the time guard: usually takes about {step.estimate_s:.0f} s, {max(left, 0):.0f} s of '
                f'the {budget_s:.0f} s budget left'), compile_mode=step.compile_mode))
        else:
            timeout_s = min(step.timeout_s, left)
            log(f'\n===== {step.name}: {" ".join(step.argv)} (limit {timeout_s:.0f} s)\n')
            started = clock()
            returncode, timed_out, output = runner(step.argv, timeout_s, log)
            seconds = clock() - started
            status = 'timed out' if timed_out else 'ok' if returncode == 0 else 'failed'
            note = f'stopped at its limit of {timeout_s:.0f} s' if timed_out else (
                '' if returncode == 0 else f'exit status {returncode}')
            data = None
            if step.json_path and Path(step.json_path).is_file():
                try:
                    data = json.loads(Path(step.json_path).read_text())
                except json.JSONDecodeError as error:
                    note = (note + '; ' if note else '') + f'its JSON is unreadable: {error}'
            results.append(StepResult(step.name, step.kind, status, seconds, returncode, note, _tail(output), data,
                                      step.compile_mode))
        if after_step is not None:
            after_step(results)
    return results


def environment_facts() -> dict[str, Any]:
    """The GPU, driver and software versions (``nvidia-smi`` where present)."""
    import timm
    import torch
    facts: dict[str, Any] = {'python': platform.python_version(), 'torch': torch.__version__,
                             'timm': timm.__version__, 'cuda': torch.version.cuda,
                             'cudnn': torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
                             'cuda_available': torch.cuda.is_available(), 'platform': platform.platform(),
                             'cpu_count': os.cpu_count()}
    if torch.cuda.is_available():
        facts['gpu'] = torch.cuda.get_device_name(0)
        facts['compute_capability'] = '.'.join(map(str, torch.cuda.get_device_capability(0)))
        facts['gpu_memory_gib'] = round(torch.cuda.get_device_properties(0).total_memory / 2 ** 30, 1)
    if shutil.which('nvidia-smi'):
        try:
            query = subprocess.run(['nvidia-smi', '--query-gpu=name,driver_version,memory.total,clocks.max.sm',
                                    '--format=csv,noheader'], capture_output=True, text=True, timeout=30)
            facts['nvidia_smi'] = query.stdout.strip() or query.stderr.strip()
            facts['driver'] = query.stdout.split(',')[1].strip() if query.stdout.count(',') >= 1 else None
        except (OSError, subprocess.TimeoutExpired) as error:
            facts['nvidia_smi'] = f'failed: {error}'
    return facts


def _copy_time(device: str, repeats: int) -> tuple[int, float]:
    """(bytes, median ms) of a device-to-device copy of 1 GiB (16 MiB on the CPU)."""
    import torch
    copy_bytes = 2 ** 30 if device == 'cuda' else 2 ** 24
    source = torch.randn(copy_bytes // 4, device=device)
    target = torch.empty_like(source)
    return copy_bytes, _median_ms(lambda: target.copy_(source), device, repeats)


def _median_ms(call: Callable[[], Any], device: str, repeats: int, warmup: int = 3) -> float:
    """The median time of ``call`` over ``repeats`` runs after ``warmup``: CUDA events on a GPU, the clock elsewhere."""
    import torch
    for _ in range(warmup):
        call()
    times = []
    for _ in range(repeats):
        if device == 'cuda':
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            call()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            began = time.perf_counter()
            call()
            times.append((time.perf_counter() - began) * 1e3)
    return sorted(times)[len(times) // 2]


def _relative_error(ours: Any, reference: Any) -> float:
    return ((ours.float() - reference).norm() / reference.norm().clamp_min(1e-30)).item()


def l2_normalize_inputs(name: str, batch: int, img_size: int = 224) -> list[dict[str, Any]]:
    """The q and k inputs of ``lipsformer::l2_normalize`` in a training forward of the model ``name``'s fast form at
    ``img_size``: each distinct (shape, strides), the leading (windows or stripes) dimension scaled to ``batch``
    images, with the calls a forward makes. Read from the op's calls in a forward of the fast form on the CPU (batch
    1, parameters requiring gradients, where the op runs as on a GPU), so that the layouts are the models' own: views
    of the qkv projection, tokens before heads."""
    import timm
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    import lipsformer  # noqa: F401  (registers the models)
    from lipsformer.fastpath import to_fast_form

    calls: dict[tuple, int] = {}

    class Record(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if func is torch.ops.lipsformer.l2_normalize.default:
                key = (tuple(args[0].shape), args[0].stride())
                calls[key] = calls.get(key, 0) + 1
            return func(*args, **(kwargs or {}))

    model = to_fast_form(timm.create_model(name, img_size=img_size), 'cuda')
    with Record():
        model(torch.randn(1, 3, img_size, img_size))
    return [{'shape': [shape[0] * batch, *shape[1:]], 'strides': list(strides), 'calls': count}
            for (shape, strides), count in calls.items()]


def l2_normalize_benchmark(batch: int = 128, device: str = 'cuda', precision: str = 'bf16', repeats: int = 20,
                           models: tuple[str, ...] = OP_MODELS, tau: float = 10.0) -> dict[str, Any]:
    """SCSA's q/k normalisation, forward and backward, as the fast form calls it (``l2_normalize_op``: the
    ``lipsformer::l2_normalize`` op, one Triton kernel a pass on a GPU, its output laid out as its input) against the
    plain model's ``F.normalize``, on every input layout of ``models``' fast forms (:func:`l2_normalize_inputs`); each
    backward through autograd, with a gradient laid out as that form's output. Median times, the bytes each pass must
    move (forward: x read, y written; backward: the gradient and y read, x's gradient written), the op's share of a
    measured device copy's rate, and each pass's error relative to a float64 reference. Inputs smaller than a few
    hundred MB rotate among copies, so that a pass is timed from memory rather than from the cache its previous run
    left."""
    import torch
    import torch.nn.functional as F

    from lipsformer.fastpath import l2_normalize_op
    from lipsformer.instruments.model_specs import PRECISIONS
    dtype = PRECISIONS[precision]
    copy_bytes, copy_ms = _copy_time(device, repeats)
    measured = 2 * copy_bytes / (copy_ms / 1e3)
    eps = 1e-12
    forms = {'op': lambda x: l2_normalize_op.l2_normalize_op(x, eps, tau),
             'plain': lambda x: F.normalize(x, dim=-1, eps=eps) * tau}
    rows = []
    for name in models:
        for entry in l2_normalize_inputs(name, batch):
            shape, strides = entry['shape'], entry['strides']
            span = 1 + sum((size - 1) * stride for size, stride in zip(shape, strides))
            copies = max(1, min(8, -(-2 ** 28 // (span * dtype.itemsize))))
            xs = [torch.randn(span, device=device, dtype=dtype).as_strided(shape, strides) for _ in range(copies)]
            # each form's graph a copy, the gradient laid out as the form's output (as attention's backward gives it)
            graphs: dict[str, list[tuple[Any, Any, Any]]] = {}
            for form, call in forms.items():
                graphs[form] = []
                for x in xs:
                    leaf = x.detach().requires_grad_()
                    y = call(leaf)
                    graphs[form].append((leaf, y, torch.randn_like(y)))
            turn = iter(range(10 ** 9))

            def forward(form: str, index: int | None = None) -> Any:
                with torch.no_grad():
                    return forms[form](xs[next(turn) % copies if index is None else index])

            def backward(form: str, index: int | None = None) -> Any:
                leaf, y, grad = graphs[form][next(turn) % copies if index is None else index]
                return torch.autograd.grad(y, leaf, grad, retain_graph=True)[0]

            x64 = xs[0].double().requires_grad_()
            y64 = F.normalize(x64, dim=-1) * tau

            def reference(pass_name: str, form: str) -> Any:
                """The float64 result of a pass, the backward's for the gradient that form's graph holds."""
                if pass_name == 'forward':
                    return y64.detach().float()
                return torch.autograd.grad(y64, x64, graphs[form][0][2].double(), retain_graph=True)[0].float()

            value_bytes = math.prod(shape) * dtype.itemsize
            for pass_name, run in (('forward', forward), ('backward', backward)):
                moved = (2 if pass_name == 'forward' else 3) * value_bytes
                op_ms = _median_ms(lambda: run('op'), device, repeats)
                plain_ms = _median_ms(lambda: run('plain'), device, repeats)
                rows.append({'model': name, **entry, 'pass': pass_name, 'op_ms': op_ms, 'plain_ms': plain_ms,
                             'speedup': plain_ms / op_ms, 'bytes': moved,
                             'op_fraction_of_copy': moved / (op_ms / 1e3) / measured,
                             'op_relative_error': _relative_error(run('op', 0), reference(pass_name, 'op')),
                             'plain_relative_error': _relative_error(run('plain', 0), reference(pass_name, 'plain'))})
    return {'batch': batch, 'device': device, 'precision': precision, 'tau': tau, 'copy_bandwidth': measured,
            'triton': l2_normalize_op.l2_normalize_kernels_run_on(torch.empty(0, device=device, dtype=dtype)),
            'rows': rows}


def _l2_table(report: dict) -> str:
    lines = [f'A device copy moved {report["copy_bandwidth"] / 1e12:.2f} TB/s (bytes read and written); the forward '
             f'moves two tensors of the shape, the backward three. Time per call (median), the op '
             f'({"Triton" if report["triton"] else "PyTorch"}) against `F.normalize` and autograd\'s backward of it.',
             '', '| model | shape (strides) | calls/step | pass | op (ms) | PyTorch (ms) | PyTorch/op | op of copy | '
             'rel. error: op, PyTorch |', '|---|---|---:|---|---:|---:|---:|---:|---|']
    for row in report['rows']:
        lines.append(f'| `{row["model"]}` | {"x".join(map(str, row["shape"]))} ({", ".join(map(str, row["strides"]))})'
                     f' | {row["calls"]} | {row["pass"]} | {row["op_ms"]:.3f} | {row["plain_ms"]:.3f} | '
                     f'{row["speedup"]:.2f}x | {row["op_fraction_of_copy"]:.0%} | {row["op_relative_error"]:.1e}, '
                     f'{row["plain_relative_error"]:.1e} |')
    return '\n'.join(lines)


def _cudnn_table(results: list[StepResult]) -> str:
    """Eager training with cuDNN's autotuning on (the eager step's training rows) and off (the ``cudnn`` step), model
    by model: images/s with the ratio to the first model, on over off, and the first step of each (where autotuning
    times the kernels)."""
    runs: dict[bool, dict[str, dict]] = {}
    for result in results:
        if result.kind in ('eager', 'cudnn') and result.data:  # a benchmark report records its autotuning
            runs[result.data['config']['cudnn_benchmark']] = {row['model']: row for row in _rows(result.data, 'train')}
    if False not in runs:
        return ''
    models = list(dict.fromkeys(model for rows in runs.values() for model in rows))
    lines = ['| model | autotuning on (img/s) | off (img/s) | on over off | first step on, off (s) |',
             '|---|---|---|---:|---|']

    def speed(row: dict | None) -> str:
        return '-' if row is None else f'{row["images_per_s"]:.0f}: {row["ratio"]:.2f}x'

    for model in models:
        on, off = runs.get(True, {}).get(model), runs.get(False, {}).get(model)
        gain = f'{on["images_per_s"] / off["images_per_s"]:.2f}x' if on and off else '-'
        first = ', '.join('-' if row is None or row.get('first_step_s') is None else f'{row["first_step_s"]:.1f}'
                          for row in (on, off))
        lines.append(f'| `{model}` | {speed(on)} | {speed(off)} | {gain} | {first} |')
    return '\n'.join(lines) if models else ''


def _rows(report: dict | None, mode: str) -> list[dict]:
    return [row for row in (report or {}).get('results', []) if row['mode'] == mode]


def _eager_table(report: dict) -> str:
    lines = ['| model | training (img/s) | inference (img/s) | training, profiled: kernels/step, device busy '
             '(of the timed step) | attention ops |', '|---|---|---|---|---|']
    train, infer = {row['model']: row for row in _rows(report, 'train')}, {
        row['model']: row for row in _rows(report, 'infer')}
    for model in report['config']['models']:
        cells = []
        for rows in (train, infer):
            row = rows.get(model)
            if row is None:
                cells.append('-')
                continue
            low, high = row['ratio_quartiles']
            cells.append(f'{row["images_per_s"]:.0f}: {row["ratio"]:.2f}x '
                         f'({row["ratio_median"]:.2f}, {low:.2f}-{high:.2f})')
        profile = (train.get(model) or {}).get('profile') or {}
        busy = profile.get('busy_fraction_of_timed_step')
        ops = sorted({name.removeprefix('aten::') for rows in (train, infer) if model in rows
                      for name in ((rows[model].get('profile') or {}).get('sdpa_ops') or [])})
        cells.append(f'{profile.get("kernels_per_step", 0):.0f}, {"-" if busy is None else f"{busy:.2f}"}'
                     if profile else '-')
        cells.append(', '.join(ops) or '-')
        lines.append(f'| `{model}` | ' + ' | '.join(cells) + ' |')
    return '\n'.join(lines)


def _top_kernels(report: dict) -> str:
    parts = []
    for row in report.get('results', []):
        profile = row.get('profile') or {}
        if not profile.get('top_kernels'):
            continue
        parts.append(f'\n`{row["model"]}`, {row["mode"]}: {profile["kernels_per_step"]:.0f} kernels a step; SDPA '
                     f'kernels: {", ".join(profile["sdpa_kernels"]) or "none"}\n')
        parts.append('| kernel | calls/step | ms/step | share |\n|---|---:|---:|---:|')
        parts += [f'| `{kernel["name"][:100]}` | {kernel["calls_per_step"]:.1f} | {kernel["ms_per_step"]:.3f} | '
                  f'{kernel["share"] or 0:.1%} |' for kernel in profile['top_kernels']]
    return '\n'.join(parts)


def _kinds_table(reports: list[tuple[str, dict | None]]) -> str:
    """Device time a step by kernel kind (``step_profile.kernel_kind``) of every profiled row of ``reports``
    (label, benchmark report)."""
    from lipsformer.instruments.step_profile import KERNEL_KINDS
    kinds = [kind for kind, _ in KERNEL_KINDS if kind != 'annotation'] + ['other']
    lines = ['| model | run | mode | ' + ' | '.join(kinds) + ' | busy |', '|---|---|---|' + '---:|' * (len(kinds) + 1)]
    for label, report in reports:
        for row in (report or {}).get('results', []):
            by_kind = (row.get('profile') or {}).get('ms_per_step_by_kind')
            if by_kind:
                lines.append(f'| `{row["model"]}` | {label} | {row["mode"]} | '
                             + ' | '.join(f'{by_kind.get(kind, 0.0):.1f}' for kind in kinds)
                             + f' | {row["profile"]["device_busy_ms_per_step"]:.1f} |')
    return '\n'.join(lines) if len(lines) > 2 else ''


def _compiled_table(results: list[StepResult], eager: dict | None) -> str:
    """A row a compiled run and mode (training, and inference where the run has it): the first step (compilation
    included), images/s with the ratio to timm's Swin-T compiled in the same mode and mode of the run, over the same
    model eager, and the training step's peak memory."""
    eager_rows = {mode: {row['model']: row for row in _rows(eager, mode)} for mode in ('train', 'infer')}
    compiled = [(result, result.name.removeprefix('compiled ').rsplit(' (', 1)[0],
                 {mode: (_rows(result.data, mode) or [None])[0] for mode in ('train', 'infer')})
                for result in results if result.kind == 'compiled']
    # timm's Swin-T compiled in each mode, wherever the plan runs it: the rows of that mode take their ratio to it
    references = {result.compile_mode: rows for result, model, rows in compiled if model == TIMM_SWIN}
    lines = ['| model | compile mode | run | first step (s) | img/s: over timm Swin-T, same compile mode | '
             'over eager | peak (MiB) |', '|---|---|---|---:|---|---:|---:|']
    for result, model, rows in compiled:
        if rows['train'] is None and rows['infer'] is None:
            lines.append(f'| `{model}` | {result.compile_mode} | - | {result.note or result.status} | | | |')
            continue
        for mode, row in rows.items():
            if row is None:
                continue
            reference = (references.get(result.compile_mode) or {}).get(mode)
            ratio = f': {row["images_per_s"] / reference["images_per_s"]:.2f}x' if reference else ''
            eager_row = eager_rows[mode].get(model)
            over_eager = f'{row["images_per_s"] / eager_row["images_per_s"]:.2f}x' if eager_row else '-'
            peak = row.get('cuda_peak_memory_mb_in_process')
            peak = '-' if peak is None else f'{peak:.0f}'
            lines.append(f'| `{model}` | {result.compile_mode} | {mode} | {row["first_step_s"]:.1f} | '
                         f'{row["images_per_s"]:.0f}{ratio} | {over_eager} | {peak} |')
    return '\n'.join(lines)


def write_gpu_report(results: list[StepResult], out_dir: Path, budget_s: float, elapsed_s: float,
                 cpu_smoke: bool = False) -> tuple[Path, Path]:
    """Write ``gpu_check.json`` (every step, the benchmark reports included) and ``gpu_check.md`` (tables)."""
    by_kind: dict[str, list[StepResult]] = {}
    for result in results:
        by_kind.setdefault(result.kind, []).append(result)
    environment = (by_kind.get('environment') or [StepResult('', '', '')])[0].data or {}
    eager = (by_kind.get('eager') or [StepResult('', '', '')])[0].data
    memory = (by_kind.get('memory') or [StepResult('', '', '')])[0].data
    ops = (by_kind.get('ops') or [StepResult('', '', '')])[0].data
    cudnn_off = (by_kind.get('cudnn') or [StepResult('', '', '')])[0].data
    report = {'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'), 'cpu_smoke': cpu_smoke,
              'budget_s': budget_s, 'elapsed_s': round(elapsed_s, 1), 'environment': environment,
              'steps': [dataclasses.asdict(result) | {'data': None} for result in results],
              'eager': eager, 'cudnn_autotuning_off': cudnn_off, 'l2_normalize': ops,
              'compiled': [result.data for result in by_kind.get('compiled', [])], 'peak_memory': memory}
    json_path, md_path = out_dir / 'gpu_check.json', out_dir / 'gpu_check.md'
    json_path.write_text(json.dumps(report, indent=1) + '\n')
    card = environment.get('gpu') or environment.get('nvidia_smi') or 'no GPU'
    md = [f'# GPU check{" (CPU smoke run)" if cpu_smoke else ""}', '',
          f'{card}; driver {environment.get("driver", "-")}; torch {environment.get("torch", "-")}, CUDA '
          f'{environment.get("cuda", "-")}, cuDNN {environment.get("cudnn", "-")}, '
          f'timm {environment.get("timm", "-")}, '
          f'Python {environment.get("python", "-")}; {report["date"]}; {elapsed_s:.0f} s of a {budget_s:.0f} s budget.',
          '', '| step | status | seconds | note |', '|---|---|---:|---|']
    md += [f'| {result.name} | {result.status} | {result.seconds:.0f} | {result.note} |' for result in results]
    for pytest_result in by_kind.get('pytest', []):
        if pytest_result.output_tail:
            summary = [line for line in pytest_result.output_tail.splitlines() if line.strip()][-1:]
            md += ['', f'{pytest_result.name}: {summary[0] if summary else "-"}']
    if eager:
        md += ['', '## Eager, interleaved in one process', '',
               'Images/s with the ratio to the first model and, in brackets, the median (interquartile range) of the '
               'per-repeat ratios.', '', _eager_table(eager)]
        if top_kernels := _top_kernels(eager):
            md += ['', '### Top kernels by time', top_kernels]
    if by_kind.get('compiled'):
        md += ['', '## Compiled (torch.compile), one process per model', '',
               'The first step includes compilation (a mode after the default finds the kernels that one compiled '
               'in inductor\'s cache); ratios to timm\'s Swin-T compiled in the same mode, and to the same model '
               'eager.', '', _compiled_table(results, eager)]
    kinds = _kinds_table([('eager', eager)] + [(f'compiled, {result.compile_mode}', result.data)
                                               for result in by_kind.get('compiled', [])])
    if kinds:
        md += ['', '## Device time a step by kernel kind (ms, profiled steps)', '', kinds]
    if cudnn_table := _cudnn_table(results):
        md += ['', '## cuDNN autotuning: eager training with it on and off, a process each', '',
               'Images/s with the ratio to the first model (autotuning on: the eager step\'s training rows); the '
               'first step of each model includes autotuning\'s timing of cuDNN\'s kernels.', '', cudnn_table]
    if ops:
        md += ['', '## q/k normalisation: lipsformer::l2_normalize against PyTorch', '', _l2_table(ops)]
    if memory:
        md += ['', '## Peak memory of an eager training step (fresh process each)', '',
               '| model | peak (MiB) | ratio |', '|---|---:|---:|']
        for row in _rows(memory, 'train'):
            if row.get('peak_memory_mb') is not None:
                ratio = '-' if row['memory_ratio'] is None else f'{row["memory_ratio"]:.2f}x'
                md.append(f'| `{row["model"]}` | {row["peak_memory_mb"]:.0f} | {ratio} |')
    md_path.write_text('\n'.join(md) + '\n')
    return md_path, json_path


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog='scripts/gpu_check.sh OUT_DIR',
        description='The GPU check: environment, eager benchmark with profiles, compiled training, eager training '
                    'with cuDNN autotuning off, the q/k normalisation op, peak memory, tests/test_cuda.py, under a '
                    'time guard; writes gpu_check.md, gpu_check.json and gpu_check.log.')
    parser.add_argument('--out', type=Path, help='the folder for the report (created)')
    parser.add_argument('--budget', type=float, default=DEFAULT_BUDGET_S,
                        help=f'seconds for the steps; a step that would not fit is skipped, and the driver ends '
                             f'{HARD_LIMIT_MARGIN_S} s after it whatever it is doing (default: %(default)s)')
    parser.add_argument('--cpu-smoke', action='store_true', help='tiny models on the CPU: every step, in little time')
    parser.add_argument('--dry-run', action='store_true', help='print the steps and their commands, run nothing')
    parser.add_argument('--steps', default=','.join(KINDS),
                        help='comma list of the steps to run, of %(default)s (default: all)')
    parser.add_argument('--cudnn-benchmark', action=argparse.BooleanOptionalAction, default=True,
                        help='cuDNN autotuning in every step, as timm\'s scripts set it (default: on, and a step '
                             'times training with it off for comparison)')
    parser.add_argument('--environment', type=Path, help=argparse.SUPPRESS)  # the environment step's own entry
    # the ops step's own entry (l2_normalize_benchmark) and its settings
    parser.add_argument('--op-benchmark', type=Path, help=argparse.SUPPRESS)
    parser.add_argument('--batch-size', type=int, default=128, help=argparse.SUPPRESS)
    parser.add_argument('--device', default='cuda', help=argparse.SUPPRESS)
    parser.add_argument('--precision', default='bf16', choices=('bf16', 'fp16', 'fp32'), help=argparse.SUPPRESS)
    parser.add_argument('--repeats', type=int, default=20, help=argparse.SUPPRESS)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.environment is not None:
        args.environment.write_text(json.dumps(environment_facts(), indent=1) + '\n')
        return 0
    if args.op_benchmark is not None:
        from lipsformer.utils.processes import set_cudnn_benchmark
        set_cudnn_benchmark(args.cudnn_benchmark)
        report = l2_normalize_benchmark(args.batch_size, args.device, args.precision, args.repeats)
        args.op_benchmark.write_text(json.dumps(report, indent=1) + '\n')
        print(_l2_table(report))
        return 0
    if args.out is None:
        parser.error('give the folder for the report: --out OUT_DIR')
    if args.budget <= RESERVE_S:
        parser.error(f'--budget must be more than {RESERVE_S} s, got {args.budget}')
    kinds = {kind.strip() for kind in args.steps.split(',') if kind.strip()}
    if not kinds or kinds - set(KINDS):
        parser.error(f'--steps must be a comma list of {", ".join(KINDS)}, got {args.steps!r}')
    with tempfile.TemporaryDirectory(prefix='gpu_check_') as work:
        steps = plan_steps(Path(work), args.cpu_smoke, kinds, args.cudnn_benchmark)
        if args.dry_run:
            for step in steps:
                print(f'{step.name}: about {step.estimate_s:.0f} s, limit {step.timeout_s:.0f} s')
                print(f'  {" ".join(step.argv)}')
            return 0
        args.out.mkdir(parents=True, exist_ok=True)
        log_path = args.out / 'gpu_check.log'
        log_path.write_text('')

        def log(text: str) -> None:
            with log_path.open('a') as file:
                file.write(text)
            print(text, end='' if text.endswith('\n') else '\n', flush=True)

        begin = time.monotonic()

        def report(results: list[StepResult]) -> None:
            write_gpu_report(results, args.out, args.budget, time.monotonic() - begin, args.cpu_smoke)

        # SIGALRM's default action ends the process even while it is stuck outside Python; children do not inherit it
        signal.alarm(math.ceil(args.budget) + HARD_LIMIT_MARGIN_S)
        try:
            results = run_steps(steps, args.budget, log, after_step=report)
            md_path, _ = write_gpu_report(results, args.out, args.budget, time.monotonic() - begin, args.cpu_smoke)
        finally:
            signal.alarm(0)
    print(md_path.read_text())
    return 0 if all(result.status in ('ok', 'skipped') for result in results) else 1


if __name__ == '__main__':
    sys.exit(main())
