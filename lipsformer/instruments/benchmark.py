"""Throughput and memory benchmark of timm models, LipsFormer's included: ``lipsformer-benchmark``.

Example (the CPU comparison of ``docs/performance.md``)::

    python -m lipsformer.instruments.benchmark --models lipsformer_swin_tiny,swin_tiny_patch4_window7_224 \\
        --mode infer,train --batch-size 16 --img-size 224 --precision fp32 --device cpu --json cpu.json

Models are timm names, optionally with constructor arguments in brackets (``lipsformer_swin_tiny[img_size=384,
window_size=12]``; ``img_size`` there also sets that model's input size; ``fast_path=False`` or ``True`` runs that model
with ``lipsformer.fastpath`` switched off or on whatever the device's default, and ``compile=True``,
``compile=regional`` / ``compile=whole`` (each LipsFormer block once per block shape, the default, or the whole model)
or ``compile=reduce-overhead`` (any ``torch.compile`` mode; ``compile_mode=`` names it beside a scope:
``[compile=regional,compile_mode=reduce-overhead]``) through ``torch.compile``, ``compile=False`` eager, whatever
``--compile`` says; so these forms of one model are timed in one process), or ``file:/path/module.py:factory[...]`` for
a model outside timm (the factory is any callable returning an ``nn.Module``; the file is imported and run, so only name
files you trust). Per model and mode it reports images/s (models interleaved in the warm-up and in every repeat, median
of the repeats), the median and interquartile range of its per-repeat ratios to the first model (paired within each
repeat: the steadier figure when another job disturbs some repeats), the process's minor page faults per timed step,
peak memory (each model in a fresh process), activations saved for backward per image, params, GMACs and TFLOP/s, with
ratios to the first model; ``docs/performance.md`` says how each is measured. cuDNN autotunes, as in timm's
benchmark.py (``--no-cudnn-benchmark``: its heuristic's kernels; the report's ``config`` says which). With ``--json``,
the report is also written after each mode, ``complete`` false until the end, so that a run cut short keeps the modes
it finished.
"""

import argparse
import contextlib
import ctypes
import datetime
import functools
import os
import pickle
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import timm
import torch
from timm.optim import create_optimizer_v2
from torch import nn

from lipsformer.fastpath import use_fast_path
from lipsformer.instruments.complexity import build_model, model_complexity
from lipsformer.instruments.model_specs import (
    COMPILE_SCOPES,
    MODES,
    PRECISIONS,
    ModelSpec,
    add_step_arguments,
    check_report_path,
    parse_model_specs,
    rejected_argument_message,
    step_loss,
    step_modes,
    write_json_report,
)
from lipsformer.models._base import LipsFormerBlock
from lipsformer.training import weight_casts
from lipsformer.training.compilation import compile_model, effective_mode
from lipsformer.utils import cpu_details, cpu_name, minor_page_faults, peak_rss_mb
from lipsformer.utils.cli import EXIT_INTERRUPTED, command_name, ctrl_c_deferred, usage_error
from lipsformer.utils.cpu_memory import retain_freed_memory
from lipsformer.utils.processes import set_cudnn_benchmark

__all__ = ['BenchmarkConfig', 'ModelSpec', 'check_report_path', 'main', 'parse_model_specs', 'report_table',
           'run_benchmark', 'saved_activations_mb', 'write_json_report']

TRAIN_MACS_PER_FORWARD_MAC = 3  # forward + backward (grad of inputs and of weights)


@dataclass
class BenchmarkConfig:
    """Settings shared by every model of one benchmark run."""

    batch_size: int = 64
    img_size: int = 224
    precision: str = 'fp32'
    compile: bool = False
    compile_mode: str | None = None  # torch.compile's mode (default, reduce-overhead, max-autotune...); None: default
    compile_scope: str = 'regional'  # what --compile compiles: each LipsFormer block (regional) or the whole model
    channels_last: bool = False
    device: str = 'cpu'
    # Without retained memory (--no-retain-cpu-memory) a model page-faults its activations in again for its first few
    # training steps on CPU: fewer warm-up steps would time that transient, more cost run time (docs/performance.md).
    warmup: int = 5
    repeats: int = 5
    steps: int | None = None  # steps per timed run; None: 1 on CPU, 10 on CUDA
    memory: bool = True
    threads: int | None = None  # torch intra-op threads on CPU; None: torch's default (one per core)
    retain_cpu_memory: bool = True  # lipsformer.utils.cpu_memory.retain_freed_memory() in every process on CPU
    profile_steps: int = 0  # steps of each model and mode profiled after its timed runs (instruments.step_profile)
    count_kernels: bool = False  # instruments.kernel_count's counts of each model and mode, as CUDA eager runs them
    # cuDNN autotuning (torch.backends.cudnn.benchmark) in every process: the warm-up's first step of each model and
    # mode times cuDNN's kernels, so the timed steps run the fastest
    cudnn_benchmark: bool = True

    def steps_per_run(self) -> int:
        return self.steps or (10 if self.device.startswith('cuda') else 1)


def _input_size(spec: ModelSpec, config: BenchmarkConfig) -> int:
    return spec.kwargs.get('img_size', config.img_size)


def _build(spec: ModelSpec, config: BenchmarkConfig) -> tuple[nn.Module, torch.Tensor]:
    """Build the model and a fixed random input batch on the benchmark device."""
    kwargs = {key: value for key, value in spec.kwargs.items() if key != 'img_size'}
    img_size = _input_size(spec, config)
    model = spec.in_form(build_model(spec.factory(), img_size=img_size, device=config.device, **kwargs),
                         torch.device(config.device).type)
    in_chans = kwargs.get('in_chans', (getattr(model, 'pretrained_cfg', None) or {}).get('input_size', (3,))[0])
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(config.batch_size, in_chans, img_size, img_size, generator=generator).to(config.device)
    if config.channels_last:
        model = model.to(memory_format=torch.channels_last)
        inputs = inputs.contiguous(memory_format=torch.channels_last)
    return model, inputs


def _count(spec: ModelSpec, model: nn.Module, config: BenchmarkConfig) -> dict:
    """Params and GMACs on the meta device (on the built model if the factory cannot run on meta), and whether the
    model has LipsFormer blocks (which a regional compilation compiles)."""
    kwargs = {key: value for key, value in spec.kwargs.items() if key != 'img_size'}
    img_size = _input_size(spec, config)
    blocks = dict(lipsformer_blocks=any(isinstance(module, LipsFormerBlock) for module in model.modules()))
    try:
        return model_complexity(spec.factory(), img_size=img_size, **kwargs) | blocks
    except RuntimeError:
        in_chans = {key: kwargs[key] for key in ('in_chans',) if key in kwargs}
        return model_complexity(model, img_size=img_size, **in_chans) | blocks


def _autocast(config: BenchmarkConfig) -> torch.autocast:
    dtype = PRECISIONS[config.precision]
    return torch.autocast(torch.device(config.device).type, dtype=dtype, enabled=dtype != torch.float32)


def saved_activations_mb(model: nn.Module, inputs: torch.Tensor, config: BenchmarkConfig) -> float:
    """MiB per image that autograd keeps for the backward of one training-mode forward of ``model`` on ``inputs``.

    Every tensor saved for backward passes through ``torch.autograd.graph.saved_tensors_hooks``; each distinct storage
    is counted once, at its full size (a saved view keeps its whole base alive), and parameters' storages are left
    out. The eager model is measured, also when the timed steps are compiled.
    """
    was_training = model.training
    model.train()
    parameters = {parameter.untyped_storage().data_ptr() for parameter in model.parameters()}
    sizes: dict[int, int] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in parameters:
            sizes.setdefault(storage.data_ptr(), storage.nbytes())
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor), _autocast(config):
        model(inputs)  # the graph, and the tensors it saved, are freed on return
    model.train(was_training)
    return sum(sizes.values()) / 2 ** 20 / inputs.shape[0]


def compile_mode(spec: ModelSpec | None, config: BenchmarkConfig) -> str | None:
    """The ``torch.compile`` mode ``spec``'s model runs in ('default' for the default mode), or None for eager: the
    spec's ``compile`` / ``compile_mode`` keys, else ``--compile`` / ``--compile-mode`` (``config``)."""
    default = (config.compile_mode or 'default') if config.compile else None
    return default if spec is None else spec.compile_mode(default)


def compile_scope(spec: ModelSpec | None, config: BenchmarkConfig, has_blocks: bool = True) -> str | None:
    """What ``spec``'s model compiles, or None for eager: ``regional`` (its LipsFormer blocks, one by one) or
    ``whole``, as the spec's ``compile`` key or ``--compile-scope`` says; a model without LipsFormer blocks
    (``has_blocks`` False) compiles whole."""
    if compile_mode(spec, config) is None:
        return None
    scope = config.compile_scope if spec is None else spec.compile_scope(config.compile_scope)
    return scope if has_blocks else 'whole'


def _make_step(model: nn.Module, inputs: torch.Tensor, mode: str, config: BenchmarkConfig,
               spec: ModelSpec | None = None) -> Callable[[], None]:
    """One inference forward, or one training step (forward, loss, backward, AdamW), compiled as :func:`compile_mode`
    says for ``spec`` (without one, as ``config`` says)."""
    device_type = torch.device(config.device).type
    dtype = PRECISIONS[config.precision]
    torch_compile_mode = compile_mode(spec, config)
    runner = model
    if torch_compile_mode is not None:  # a regional compilation compiles the model's blocks in place
        runner, _ = compile_model(model, compile_scope(spec, config), torch_compile_mode, device_type)
    if mode == 'infer':
        model.eval()

        @torch.no_grad()
        def infer_step() -> None:
            with _autocast(config):
                runner(inputs)
        return infer_step

    model.train()
    optimizer = create_optimizer_v2(model, opt='adamw', lr=1e-4, weight_decay=0.05)
    scaler = torch.amp.GradScaler(device_type, enabled=dtype == torch.float16)
    targets: dict[str, torch.Tensor] = {}

    casts = contextlib.nullcontext
    if torch_compile_mode is None and (spec is None or spec.grouped_weight_casts is not False) \
            and weight_casts.refusal_reason(model) is None:
        casts = functools.partial(weight_casts.GroupedWeightCasts(model).applied, device_type)

    def train_step() -> None:
        optimizer.zero_grad(set_to_none=True)
        with _autocast(config), casts():
            loss = step_loss(runner(inputs), targets)
        scaler.scale(loss).backward()
        scaler.step(optimizer)
        scaler.update()
    return train_step


def _time_run(step: Callable[[], None], steps: int, device: str) -> tuple[float, float]:
    """Seconds taken by ``steps`` steps (CUDA events on GPU, so queued work is timed, not launches), and the
    process's minor page faults per step meanwhile."""
    faults = minor_page_faults()
    if torch.device(device).type == 'cuda':
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        for _ in range(steps):
            step()
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3
    else:
        begin = time.perf_counter()
        for _ in range(steps):
            step()
        seconds = time.perf_counter() - begin
    return seconds, (minor_page_faults() - faults) / steps


def interleaved_order(num_models: int, repeats: int) -> list[list[int]]:
    """Model indices per repeat: all models every repeat, reversed on odd repeats so a linear drift cancels too."""
    forward = list(range(num_models))
    return [forward if repeat % 2 == 0 else forward[::-1] for repeat in range(repeats)]


def _proc_status_mb(field: str) -> float:
    for line in Path('/proc/self/status').read_text().splitlines():
        if line.startswith(field + ':'):
            return int(line.split()[1]) / 1024  # kB
    raise OSError(f'no {field} in /proc/self/status')


def _reset_peak_rss() -> float | None:
    """Make the process's peak resident size its current one (Linux >= 4.0); returns that size in MiB, or None.

    Freed memory is first handed back to the system (glibc's malloc_trim), so that a model's allocations show up as
    growth instead of reusing pages that imports had touched and freed.
    """
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass
    try:
        Path('/proc/self/clear_refs').write_text('5')
        return _proc_status_mb('VmRSS')
    except OSError:
        return None


def measure_peak_memory(spec_text: str, mode: str, config: dict) -> float:
    """Peak memory in MiB of warm-up steps of one model and mode, run in a fresh process (docs/performance.md)."""
    benchmark_config = BenchmarkConfig(**config)
    _configure_process(benchmark_config)
    spec, = parse_model_specs(spec_text)
    spec.factory()  # import the model's code before the baseline, like timm's and lipsformer's modules
    cuda = torch.device(benchmark_config.device).type == 'cuda'
    resident_mb = None if cuda else _reset_peak_rss()
    baseline_mb = peak_rss_mb() if resident_mb is None and not cuda else resident_mb
    model, inputs = _build(spec, benchmark_config)
    step = spec.running(_make_step(model, inputs, mode, benchmark_config, spec))
    for _ in range(max(2, benchmark_config.warmup)):  # the second train step is the first with optimizer state
        step()
    if cuda:
        torch.cuda.synchronize(benchmark_config.device)
        return torch.cuda.max_memory_allocated(benchmark_config.device) / 2 ** 20
    peak_mb = peak_rss_mb() if resident_mb is None else _proc_status_mb('VmHWM')
    return peak_mb - baseline_mb


def _peak_memories(specs: list[ModelSpec], modes: list[str], config: BenchmarkConfig) -> dict[tuple[str, str], float]:
    memories = {}
    for mode in modes:
        for spec in specs:
            _log(f'peak memory: {spec.text} {mode} (fresh process)')
            memories[spec.text, mode] = _call_in_fresh_process(measure_peak_memory, spec.text, mode, asdict(config))
    return memories


def _call_in_fresh_process(function: Callable[..., Any], *args: Any) -> Any:
    """``function(*args)`` in a fresh interpreter that Ctrl-C does not reach; its exception is raised here.

    A terminal's Ctrl-C sends SIGINT to its foreground process group: a child there would take it too and print a
    traceback of its own beside the benchmark's one line. So the child runs in a session of its own, which no
    terminal signals, and the interrupted benchmark ends it. (Ignoring SIGINT around the child's start, for the child
    to inherit, would lose a Ctrl-C that lands meanwhile: the signal's action is the process's, not a thread's.)
    ``function`` is one of this module's, named to the child; its arguments go pickled by value, and the result or
    exception come back pickled through a pipe of their own, so the child's prints cannot mix with them.
    """
    if globals().get(function.__name__) is not function:
        raise ValueError(f'_call_in_fresh_process runs functions of {_MODULE} only, got {function!r}')
    read_end, write_end = os.pipe()
    # this module by its name, also when it runs as __main__ (python -m), where __name__ would not find it
    command = [sys.executable, '-c', f'from {_MODULE} import _fresh_process_main; _fresh_process_main({write_end})']
    try:
        process = subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(write_end,), start_new_session=True)
    finally:
        os.close(write_end)
    with os.fdopen(read_end, 'rb') as results:
        try:
            process.stdin.write(pickle.dumps((function.__name__, args)))
            process.stdin.close()
            outcome = results.read()
            process.wait()
        except BaseException:  # Ctrl-C: the child is ended, not waited for
            process.kill()
            process.wait()
            raise
    if not outcome:
        raise RuntimeError(f'the fresh process running {function.__name__} ended without a result (exit code '
                           f'{process.returncode})')
    succeeded, value = pickle.loads(outcome)
    if not succeeded:
        raise value
    return value


def _fresh_process_main(result_fd: int) -> None:
    """The child's side of :func:`_call_in_fresh_process`: reads ``(function name, args)`` from stdin, writes
    ``(True, result)`` or ``(False, exception)`` to ``result_fd``."""
    name, args = pickle.loads(sys.stdin.buffer.read())
    function = globals()[name]
    try:
        outcome = (True, function(*args))
    except Exception as error:
        outcome = (False, error)
    try:
        data = pickle.dumps(outcome)
    except (pickle.PicklingError, TypeError, AttributeError):  # an exception that does not pickle: its text
        data = pickle.dumps((False, RuntimeError(f'{type(outcome[1]).__name__}: {outcome[1]}')))
    with os.fdopen(result_fd, 'wb') as results:
        results.write(data)


_MODULE = 'lipsformer.instruments.benchmark'


def _log(message: str) -> None:
    print(f'[benchmark] {message}', file=sys.stderr, flush=True)


@dataclass
class ModeRuns:
    """What :func:`_time_mode` measured of every model in one mode (lists in the models' order)."""

    runs: list[list[tuple[float, float]]]  # (seconds, page faults per step) of every timed run
    first_step_s: list[float | None]  # the first warm-up step (compilation included when compiled)
    profiles: list[dict | None]  # lipsformer.instruments.step_profile summaries, if asked for
    cuda_peak_memory_mb: float | None  # torch.cuda.max_memory_allocated over the mode (all its models)


def _synchronize(device: str) -> None:
    if torch.device(device).type == 'cuda':
        torch.cuda.synchronize(device)


def _time_mode(models: list[tuple[nn.Module, torch.Tensor]], mode: str, config: BenchmarkConfig,
               specs: list[ModelSpec]) -> ModeRuns:
    """Every timed run of every model, models interleaved within each repeat; then, if asked, each model's profile."""
    steps = [spec.running(_make_step(model, inputs, mode, config, spec))
             for spec, (model, inputs) in zip(specs, models)]
    names = [spec.text for spec in specs]
    cuda = torch.device(config.device).type == 'cuda'
    if cuda:
        torch.cuda.reset_peak_memory_stats(config.device)
    # Warmed up in the timed runs' order: a model warmed up alone, then left idle while the others warm up, runs its
    # first timed training step slower than its median (docs/performance.md).
    _log(f'warm-up: {mode}, {config.warmup} step(s) of each of {", ".join(names)}, interleaved')
    first_step_s: list[float | None] = [None] * len(models)
    for round_index, order in enumerate(interleaved_order(len(models), config.warmup)):
        for index in order:
            begin = time.perf_counter()
            steps[index]()
            if round_index == 0:  # a host clock around a synchronized step: compilation runs on the host
                _synchronize(config.device)
                first_step_s[index] = time.perf_counter() - begin
    runs: list[list[tuple[float, float]]] = [[] for _ in models]
    for repeat, order in enumerate(interleaved_order(len(models), config.repeats)):
        _log(f'{mode}: repeat {repeat + 1}/{config.repeats}')
        for index in order:
            runs[index].append(_time_run(steps[index], config.steps_per_run(), config.device))
    profiles: list[dict | None] = [None] * len(models)
    if config.profile_steps:
        from lipsformer.instruments.step_profile import profile_steps
        for index, (step, spec) in enumerate(zip(steps, specs)):
            _log(f'profile: {mode}, {config.profile_steps} step(s) of {spec.text}')
            step_ms = 1e3 * statistics.median(seconds for seconds, _ in runs[index]) / config.steps_per_run()
            profiles[index] = profile_steps(step, config.profile_steps, config.device, step_ms)
    peak_mb = torch.cuda.max_memory_allocated(config.device) / 2 ** 20 if cuda else None
    for model, _ in models:
        model.zero_grad(set_to_none=True)  # the optimizer and its state go with the step closures
    return ModeRuns(runs, first_step_s, profiles, peak_mb)


def _quartiles(samples: list[float]) -> list[float]:
    """The first and third quartiles of ``samples`` (each the one sample when there is only one)."""
    if len(samples) < 2:
        return [samples[0], samples[0]]
    first, _, third = statistics.quantiles(samples, n=4, method='inclusive')
    return [first, third]


def _result_row(spec: ModelSpec, mode: str, counts: dict, runs: list[tuple[float, float]],
                config: BenchmarkConfig) -> dict:
    images = config.batch_size * config.steps_per_run()
    samples = [images / seconds for seconds, _ in runs]
    faults = [step_faults for _, step_faults in runs]
    images_per_s = statistics.median(samples)
    macs_per_image = counts['gmacs'] * (TRAIN_MACS_PER_FORWARD_MAC if mode == 'train' else 1)
    torch_compile_mode = compile_mode(spec, config)
    device_type = torch.device(config.device).type
    # What this model ran with: compiled, lipsformer.fastpath steps aside for the plain graph.
    fast_path = torch_compile_mode is None and spec.running(functools.partial(use_fast_path, device_type))()
    return {
        'model': spec.text,
        'mode': mode,
        # torch.compile's mode as it ran (a CUDA-graph mode without CUDA runs without graphs), None for eager; its
        # scope; compile_s (run_benchmark) is the first warm-up step's seconds, compilation included
        'compile': None if torch_compile_mode is None else effective_mode(torch_compile_mode, device_type),
        'compile_scope': compile_scope(spec, config, counts['lipsformer_blocks']),
        'fast_path': fast_path,
        'input_size': list(counts['input_size']),
        'batch_size': config.batch_size,
        'params': counts['params'],
        'gmacs': counts['gmacs'],
        'images_per_s': images_per_s,
        'images_per_s_samples': samples,
        'ms_per_step': 1e3 * config.batch_size / images_per_s,
        'tflops': 2 * macs_per_image * images_per_s / 1e3,
        # Fresh memory touched for the first time: on CPU, how much of a step went to the kernel mapping pages in.
        'page_faults_per_step': statistics.median(faults),
        'page_faults_per_step_samples': faults,
    }


def run_benchmark(models: str | list[ModelSpec], modes: list[str], config: BenchmarkConfig,
                  progress: Callable[[dict], None] | None = None) -> dict:
    """Benchmark every model in every mode; returns the JSON-ready report (``config``, ``environment``,
    ``results``: one row per model and mode, ratios relative to the first model; ``complete``: True).

    Args:
        progress: Called with the report so far (``complete`` False) after each mode, so that a run cut short keeps
            the modes it finished.
    """
    specs = parse_model_specs(models) if isinstance(models, str) else models
    retained = _configure_process(config)
    load_at_start = _load_average()
    if invalid := set(modes) - set(MODES):
        raise ValueError(f'unknown mode(s) {sorted(invalid)}; choose from {MODES}')
    memories = _peak_memories(specs, modes, config) if config.memory else {}
    built, counts, activations = [], [], []
    for spec in specs:
        _log(f'building {spec.text}')
        model, inputs = _build(spec, config)
        counts.append(_count(spec, model, config))
        measure = spec.running(functools.partial(saved_activations_mb, model, inputs, config))
        activations.append(measure() if 'train' in modes else None)
        built.append((model, inputs))
    results = []
    for mode in modes:
        measured = _time_mode(built, mode, config, specs)
        rows = [_result_row(spec, mode, count, model_runs, config)
                for spec, count, model_runs in zip(specs, counts, measured.runs)]
        for row, first_step_s, profile in zip(rows, measured.first_step_s, measured.profiles):
            row['first_step_s'] = first_step_s
            row['compile_s'] = first_step_s if row['compile'] else None
            # One model per process: its own peak; with several, the largest of them (they share the process).
            row['cuda_peak_memory_mb_in_process'] = measured.cuda_peak_memory_mb
            if config.profile_steps:
                row['profile'] = profile
        for row, saved_mb in zip(rows, activations):
            row['ratio'] = row['images_per_s'] / rows[0]['images_per_s']
            # Paired: the models of one repeat ran back to back, so the machine's drift cancels in their quotient.
            row['ratio_samples'] = [sample / first for sample, first in
                                    zip(row['images_per_s_samples'], rows[0]['images_per_s_samples'])]
            row['ratio_median'] = statistics.median(row['ratio_samples'])
            row['ratio_quartiles'] = _quartiles(row['ratio_samples'])
            row['saved_activations_mb_per_image'] = saved_mb if mode == 'train' else None
            row['saved_activations_ratio'] = saved_mb / activations[0] if mode == 'train' and activations[0] else None
            row['peak_memory_mb'] = memories.get((row['model'], mode))
            first_memory = memories.get((rows[0]['model'], mode))
            # A model too small to move the resident size has no meaningful ratio (and no zero division).
            row['memory_ratio'] = row['peak_memory_mb'] / first_memory if config.memory and first_memory else None
        results += rows
        if progress is not None:
            progress(_report(specs, modes, config, results, load_at_start, retained, complete=False))
    report = _report(specs, modes, config, results, load_at_start, retained, complete=not config.count_kernels)
    if config.count_kernels:
        report['kernel_counts'] = [count.to_json() for count in _kernel_counts(specs, modes, config)]
        report['complete'] = True
    return report


def _report(specs: list[ModelSpec], modes: list[str], config: BenchmarkConfig, results: list[dict],
            load_at_start: list[float] | None, retained: bool, complete: bool) -> dict:
    return {'config': asdict(config) | {'steps': config.steps_per_run(), 'modes': list(modes),
                                        'models': [spec.text for spec in specs]},
            'environment': environment(config.device) | {'load_average_start': load_at_start,
                                                         'cpu_freed_memory_retained': retained},
            'results': list(results),
            'complete': complete}  # False in a report written while the run goes on


def _kernel_counts(specs: list[ModelSpec], modes: list[str], config: BenchmarkConfig) -> list:
    """lipsformer.instruments.kernel_count's counts of one step of each model and mode at the benchmark's batch, input
    size and precision, as eager CUDA runs them (counted on fake tensors, whatever the benchmark's device)."""
    from lipsformer.instruments.kernel_count import count_models  # it imports this module
    _log('counting kernels (fake CUDA tensors)')
    return count_models(specs, modes, config.batch_size, config.img_size, config.precision)


def _configure_process(config: BenchmarkConfig) -> bool:
    """Set torch's threads, cuDNN's autotuning and, if asked, glibc's retention of freed memory; returns whether memory
    is retained."""
    if config.threads is not None:
        torch.set_num_threads(config.threads)
    set_cudnn_benchmark(config.cudnn_benchmark)
    if not config.retain_cpu_memory or config.device != 'cpu':
        return False
    if not retain_freed_memory():
        _log('--retain-cpu-memory has no effect here: the C library is not glibc')
        return False
    return True


def _load_average() -> list[float] | None:
    # Recorded with each report: on a shared machine, other jobs' load is the main source of noise.
    return [round(value, 2) for value in os.getloadavg()] if hasattr(os, 'getloadavg') else None


def environment(device: str) -> dict:
    """Versions and machine, recorded with every report."""
    info = {
        'python': platform.python_version(), 'torch': torch.__version__, 'timm': timm.__version__,
        'platform': platform.platform(), 'cpu': cpu_name(), 'cpu_count': os.cpu_count(),
        'cpu_details': cpu_details(),  # CPUs sold under one name differ in generation and flags, and so in ratios
        'torch_threads': torch.get_num_threads(), 'load_average_end': _load_average(),
        # the switch for the device (LIPSFORMER_FAST_PATH, the device defaults); a model spec's fast_path overrides it
        'fast_path': use_fast_path(device.split(':')[0]),
        'memory_metric': 'cuda_max_memory_allocated' if device.startswith('cuda') else 'cpu_peak_rss_minus_baseline',
        'date': datetime.datetime.now(datetime.UTC).isoformat(timespec='seconds'),
    }
    if device.startswith('cuda'):
        info['gpu'] = torch.cuda.get_device_name(device)
        info['cuda'] = torch.version.cuda
        info['cudnn'] = torch.backends.cudnn.version()
    return info


def report_table(report: dict, markdown: bool = False) -> str:
    """The report's results as an aligned text table (or Markdown)."""
    header = ['model', 'mode', 'img/s', 'ratio', 'paired ratio (IQR)', 'ms/step', 'faults/step', 'peak MiB',
              'mem ratio', 'act MiB/img', 'act ratio', 'params (M)', 'GMACs', 'TFLOP/s', 'compiled']

    def optional(value: float | None, digits: int) -> str:
        return '-' if value is None else f'{value:.{digits}f}'

    lines = [[row['model'], row['mode'], f'{row["images_per_s"]:.2f}', f'{row["ratio"]:.3f}',
              '{:.3f} ({:.3f}-{:.3f})'.format(row['ratio_median'], *row['ratio_quartiles']),
              f'{row["ms_per_step"]:.1f}', f'{row["page_faults_per_step"]:.0f}', optional(row['peak_memory_mb'], 0),
              optional(row['memory_ratio'], 3), optional(row['saved_activations_mb_per_image'], 1),
              optional(row['saved_activations_ratio'], 3),
              f'{row["params"] / 1e6:.2f}', f'{row["gmacs"]:.2f}', f'{row["tflops"]:.3f}',
              f'{row["compile_scope"]}, {row["compile"]}' if row.get('compile') else '-']  # '-' for eager
             for row in report['results']]
    if markdown:
        return '\n'.join(['| ' + ' | '.join(header) + ' |', '|---|---|' + '---:|' * (len(header) - 2)] +
                         ['| ' + ' | '.join(line) + ' |' for line in lines])
    widths = [max(len(line[col]) for line in [header] + lines) for col in range(len(header))]
    return '\n'.join('  '.join(cell.ljust(width) if col < 2 else cell.rjust(width)
                               for col, (cell, width) in enumerate(zip(line, widths))) for line in [header] + lines)


def format_profile_table(report: dict, markdown: bool = False) -> str:
    """The profile of each row (``--profile``): device kernels per step, busy fraction of the timed step and of the
    profiled window, the attention kernels, the kernel that takes the most time."""
    header = ['model', 'mode', 'kernels/step', 'busy (timed step)', 'busy (profiled)', 'SDPA ops', 'top kernel']
    lines = []
    for row in report['results']:
        profile = row.get('profile') or {}
        top = profile.get('top_kernels') or [{}]

        def fraction(key: str) -> str:
            return '-' if profile.get(key) is None else f'{profile[key]:.2f}'
        lines.append([row['model'], row['mode'], f'{profile.get("kernels_per_step", 0):.0f}',
                      fraction('busy_fraction_of_timed_step'), fraction('busy_fraction_of_profiled_window'),
                      ', '.join(name.removeprefix('aten::') for name in profile.get('sdpa_ops', [])) or '-',
                      (top[0].get('name') or '-')[:60]])
    return _table(header, lines, markdown, left=(0, 1, 5, 6))


def _table(header: list[str], lines: list[list[str]], markdown: bool, left: tuple[int, ...] = (0, 1)) -> str:
    if markdown:
        return '\n'.join(['| ' + ' | '.join(header) + ' |',
                          '|' + ''.join('---|' if col in left else '---:|' for col in range(len(header)))] +
                         ['| ' + ' | '.join(line) + ' |' for line in lines])
    widths = [max(len(line[col]) for line in [header] + lines) for col in range(len(header))]
    return '\n'.join('  '.join(cell.ljust(width) if col in left else cell.rjust(width)
                               for col, (cell, width) in enumerate(zip(line, widths))) for line in [header] + lines)


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=command_name('lipsformer.instruments.benchmark'),
        description='Images/s, peak memory, params, GMACs and TFLOP/s of timm models (lipsformer included), '
                    'models interleaved so that ratios to the first model cancel machine drift.')
    add_step_arguments(parser, batch_size=64, precision='fp32')
    parser.add_argument('--compile', action='store_true',
                        help='torch.compile every model without a compile= key of its own (warm-up compiles)')
    parser.add_argument('--compile-mode', default=None,
                        help="torch.compile's mode with --compile: default, reduce-overhead (CUDA graphs), "
                             'max-autotune, max-autotune-no-cudagraphs (default: default)')
    parser.add_argument('--compile-scope', choices=COMPILE_SCOPES, default=None,
                        help='what --compile compiles: regional (each LipsFormer block, once per block shape; the '
                             'default; a model without them compiles whole) or whole (the whole model)')
    parser.add_argument('--channels-last', action='store_true', help='channels-last model and input')
    parser.add_argument('--device', default='cpu', help='cpu, cuda or cuda:N')
    parser.add_argument('--json', type=Path,
                        help='write the full report (every timed sample included) here, also after each mode '
                             '("complete": false until the run ends)')
    parser.add_argument('--warmup', type=int, default=BenchmarkConfig.warmup,
                        help='untimed steps per model and mode (default: %(default)s)')
    parser.add_argument('--repeats', type=int, default=BenchmarkConfig.repeats,
                        help='timed runs per model and mode (median reported; default: %(default)s)')
    parser.add_argument('--steps', type=int, default=None, help='steps per timed run (default: 1 on CPU, 10 on CUDA)')
    parser.add_argument('--threads', type=int, default=None,
                        help="torch threads on CPU (default: torch's, one per core); 1 is the least disturbed by "
                             'other jobs on a shared machine')
    parser.add_argument('--retain-cpu-memory', action=argparse.BooleanOptionalAction, default=True,
                        help='on CPU, keep freed memory in the process for reuse instead of unmapping it (glibc '
                             'malloc settings, lipsformer.utils.cpu_memory, as train.py does): large activations stop '
                             'page-faulting every step, whose cost otherwise depends on the allocation history '
                             '(default: on; --no-retain-cpu-memory measures glibc\'s defaults)')
    parser.add_argument('--cudnn-benchmark', action=argparse.BooleanOptionalAction, default=True,
                        help='cuDNN autotuning, as timm\'s benchmark.py sets it: the first step of each model, mode '
                             'and input shape times cuDNN\'s kernels and keeps the fastest (default: on; '
                             '--no-cudnn-benchmark times its heuristic\'s picks)')
    parser.add_argument('--no-memory', dest='memory', action='store_false',
                        help='skip the peak-memory child processes')
    parser.add_argument('--profile', type=int, default=0, metavar='STEPS',
                        help='after the timed runs, profile STEPS steps of each model and mode with torch.profiler '
                             '(kernels per step, device busy fraction, top kernels, attention kernels; default: 0, '
                             'none)')
    parser.add_argument('--count-kernels', action='store_true',
                        help='also count the kernels, non-matmul bytes and dispatched ops of one step of each model '
                             'and mode as eager CUDA runs them (lipsformer.instruments.kernel_count; no GPU needed)')
    parser.add_argument('--markdown', action='store_true', help='print the table as Markdown')
    return parser


def _config_from_args(args: argparse.Namespace, parser: argparse.ArgumentParser) -> BenchmarkConfig:
    for flag in ('compile_mode', 'compile_scope'):
        if getattr(args, flag) is not None and not args.compile:
            usage_error(parser, f'--{flag.replace("_", "-")} needs --compile')
    if args.profile < 0:
        usage_error(parser, f'--profile must be 0 or more, got {args.profile}')
    for name in ('repeats', 'steps', 'threads'):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            usage_error(parser, f'--{name.replace("_", "-")} must be at least 1, got {getattr(args, name)}')
    if args.warmup < 0:
        usage_error(parser, f'--warmup must be 0 or more, got {args.warmup}')
    if not re.fullmatch(r'cpu|cuda(:\d+)?', args.device):
        usage_error(parser, f'--device must be cpu, cuda or cuda:N, got {args.device}')
    if args.device.startswith('cuda') and not torch.cuda.is_available():
        usage_error(parser, f'--device {args.device}: CUDA is not available (torch.cuda.is_available() is False); '
                            f'use --device cpu')
    return BenchmarkConfig(batch_size=args.batch_size, img_size=args.img_size, precision=args.precision,
                           compile=args.compile, compile_mode=args.compile_mode,
                           compile_scope=args.compile_scope or BenchmarkConfig.compile_scope,
                           channels_last=args.channels_last, device=args.device,
                           warmup=args.warmup, repeats=args.repeats, steps=args.steps, memory=args.memory,
                           threads=args.threads, retain_cpu_memory=args.retain_cpu_memory,
                           profile_steps=args.profile, count_kernels=args.count_kernels,
                           cudnn_benchmark=args.cudnn_benchmark)


def main(argv: list[str] | None = None) -> dict:
    parser = _parser()
    args = parser.parse_args(argv)
    check_report_path(parser, args.json)
    config = _config_from_args(args, parser)
    if config.count_kernels:
        from lipsformer.instruments.kernel_count import unsupported_reason
        reason = unsupported_reason()
        if reason:
            usage_error(parser, f'--count-kernels: {reason}')
    modes = step_modes(parser, args)
    try:
        specs = parse_model_specs(args.models)
    except (TypeError, ValueError) as error:
        usage_error(parser, str(error))
    compiled = [spec for spec in specs if compile_mode(spec, config)]
    if config.count_kernels and compiled:
        usage_error(parser, f'--count-kernels counts one eager step of each model, and {compiled[0].text!r} runs '
                            f'compiled ({compile_mode(compiled[0], config)}): count it in a run without compile')
    command = ' '.join(['python -m lipsformer.instruments.benchmark'] + (sys.argv[1:] if argv is None else argv))

    kept = []  # the modes whose rows a report holds, for the line a Ctrl-C ends with

    def write_so_far(report: dict) -> None:
        with ctrl_c_deferred():  # the file and the line that names it agree
            wrote = write_json_report(parser, args.json, report | {'command': command}, partial=True)
            if wrote:
                kept[:] = report['config']['modes'][:len(report['results']) // len(specs)]
        if wrote:
            _log(f'wrote the report so far to {args.json}')
    try:
        report = run_benchmark(specs, modes, config, write_so_far if args.json is not None else None)
    except KeyboardInterrupt:
        if kept:
            held = f'the report so far ({", ".join(kept)}; complete false) is in --json {str(args.json)!r}'
        else:
            held = ('no mode had finished; nothing was written' if args.json is not None else
                    'nothing was kept (--json FILE keeps each mode as it finishes)')
        print(f'{parser.prog}: interrupted by Ctrl-C: {held}', file=sys.stderr)
        raise SystemExit(EXIT_INTERRUPTED) from None
    except ValueError as error:  # a model's own refusal of the input (LipsFormer: a multiple of 32)
        usage_error(parser, f'--img-size {config.img_size}: {error}')
    except TypeError as error:  # a constructor's refusal of a spec's argument
        message = rejected_argument_message(error, specs)
        if message is None:
            raise
        usage_error(parser, f'--models: {message}')
    report['command'] = command
    print(report_table(report, markdown=args.markdown))
    if config.profile_steps:
        print('\n' + format_profile_table(report, markdown=args.markdown))
    if config.count_kernels:
        from lipsformer.instruments.kernel_count import format_count_json_table
        print('\n' + format_count_json_table(report['kernel_counts'], markdown=args.markdown))
    if args.json is not None:
        write_json_report(parser, args.json, report)
        _log(f'wrote {args.json}')
    return report


def cli() -> int:
    """The ``lipsformer-benchmark`` command: :func:`main`, exiting 0 once the table is printed."""
    main()
    return 0


if __name__ == '__main__':
    main()
