"""lipsformer.utils.cpu_memory: freed blocks stay in the process, so reallocating them costs no page faults."""
import json
import platform
import statistics
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
                                reason='glibc malloc settings')

REALLOCATE = textwrap.dedent('''
    import json, resource, sys
    import torch
    from lipsformer.utils.cpu_memory import retain_freed_memory
    applied = retain_freed_memory() if sys.argv[1] == 'retain' else False
    elements = 64 * 2 ** 20 // 4  # 64 MiB: above glibc's largest dynamic mmap threshold (32 MiB)
    for _ in range(3):  # warm-up, like a training run's first steps: allocated, touched and freed
        torch.ones(elements)
    faults = []
    for _ in range(9):
        before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        torch.ones(elements)
        faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
    print(json.dumps({'applied': applied, 'faults': faults}))
''')


def _huge_pages_always() -> bool:
    try:
        return '[always]' in Path('/sys/kernel/mm/transparent_hugepage/enabled').read_text()
    except OSError:
        return False


# The fault counts below are of 4 KiB pages; with transparent huge pages for all memory fresh blocks fault in 2 MiB
# at a time.
counts_small_pages = pytest.mark.skipif(_huge_pages_always(), reason='transparent huge pages are set to always')


def _reallocate(mode: str) -> dict:
    completed = subprocess.run([sys.executable, '-c', REALLOCATE, mode], check=True, capture_output=True, text=True)
    return json.loads(completed.stdout)


@counts_small_pages
def test_reallocating_a_freed_block_faults_no_pages_once_memory_is_retained():
    pages = 64 * 2 ** 20 // 4096  # the pages of one 64 MiB allocation
    default, retained = _reallocate('default'), _reallocate('retain')
    # glibc's default unmaps a 64 MiB block on free: every page of each next one is faulted in again.
    assert not default['applied'] and min(default['faults']) >= 0.9 * pages
    # Retained, a reallocation reuses the freed pages; now and then one still gets its block in fresh pages (one of
    # five in a CI run), as in the benchmark's per-step count below: the median of nine is asserted.
    assert retained['applied'] and statistics.median(retained['faults']) < 0.05 * pages


def test_benchmark_records_retention_and_still_measures_peak_memory(tmp_path):
    out = tmp_path / 'report.json'
    subprocess.run(
        [sys.executable, '-m', 'lipsformer.instruments.benchmark', '--models', 'resnet10t', '--mode', 'train',
         '--batch-size', '2',
         '--img-size', '32', '--warmup', '1', '--repeats', '1', '--threads', '1', '--retain-cpu-memory',
         '--json', str(out)], check=True, capture_output=True, text=True)
    report = json.loads(out.read_text())
    assert report['config']['retain_cpu_memory'] and report['environment']['cpu_freed_memory_retained']
    row, = report['results']
    # Weights, gradients and AdamW's two moments: 16 bytes per parameter, whatever the allocator keeps.
    assert row['peak_memory_mb'] >= 16 * row['params'] / 2 ** 20


@counts_small_pages
def test_benchmark_counts_the_page_faults_of_fresh_memory_each_step(tmp_path):
    # A model that allocates, touches and frees a 64 MiB block in every forward: with glibc's defaults each step
    # faults its 16384 pages in again; with freed memory retained, after the warm-up, almost none. Not none: 3 of 60
    # retained steps still got the block in fresh pages here (and two of three did in one CI run), so the median of
    # nine steps is what is asserted.
    (tmp_path / 'fresh.py').write_text(textwrap.dedent('''
        import torch
        from torch import nn

        class FreshBlock(nn.Module):
            def __init__(self):
                super().__init__()
                self.fc = nn.Linear(3, 2)

            def forward(self, x):
                return self.fc(x.mean((2, 3))) + torch.ones(64 * 2 ** 20 // 4)[0] - 1
    '''))
    pages = 64 * 2 ** 20 // 4096
    faults = {}
    for retain in ('--no-retain-cpu-memory', '--retain-cpu-memory'):
        out = tmp_path / f'{retain}.json'
        subprocess.run(
            [sys.executable, '-m', 'lipsformer.instruments.benchmark', '--models',
             f'file:{tmp_path}/fresh.py:FreshBlock',
             '--mode', 'infer', '--batch-size', '1', '--img-size', '8', '--warmup', '2', '--repeats', '9',
             '--threads', '1', '--no-memory', retain, '--json', str(out)], check=True, capture_output=True, text=True)
        row, = json.loads(out.read_text())['results']
        faults[retain] = row['page_faults_per_step']
    assert faults['--no-retain-cpu-memory'] >= 0.9 * pages
    assert faults['--retain-cpu-memory'] < 0.05 * pages
