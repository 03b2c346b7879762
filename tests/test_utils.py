"""lipsformer.utils: writes that leave the old file or the new one whatever happens, JSON lines, machine facts."""
import os
import stat

import pytest
import torch
from safetensors.torch import load_file

from lipsformer.utils import (
    JsonLines,
    atomic_open,
    cpu_name,
    peak_memory_mb,
    peak_rss_mb,
    read_json,
    replace_dir,
    save_safetensors,
    save_torch,
    write_json,
)


def test_write_json_replaces_the_file_with_open_permissions_and_no_leftovers(tmp_path):
    path = tmp_path / 'data.json'
    write_json(path, {'a': 1})
    write_json(path, [1, 2])
    assert read_json(path) == [1, 2]
    assert os.listdir(tmp_path) == ['data.json']
    umask = os.umask(0o022)
    os.umask(umask)
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o666 & ~umask  # what open() would give, not mkstemp's 0600


def test_a_failed_write_keeps_the_old_file_and_removes_its_temporary(tmp_path):
    path = tmp_path / 'data.txt'
    path.write_text('old')
    with pytest.raises(RuntimeError, match='disk full'):
        with atomic_open(path) as f:
            f.write('half of the new')
            raise RuntimeError('disk full')
    assert path.read_text() == 'old' and os.listdir(tmp_path) == ['data.txt']


def test_torch_and_safetensors_files_round_trip(tmp_path):
    weight = torch.randn(3, 4)
    save_torch({'weight': weight}, tmp_path / 'state.pt')
    assert torch.equal(torch.load(tmp_path / 'state.pt', weights_only=True)['weight'], weight)
    save_safetensors({'a': weight, 'b': weight}, tmp_path / 'model.safetensors')  # shared storage is cloned
    loaded = load_file(tmp_path / 'model.safetensors')
    assert torch.equal(loaded['a'], weight) and torch.equal(loaded['b'], weight)
    assert sorted(os.listdir(tmp_path)) == ['model.safetensors', 'state.pt']


def test_json_lines_stop_at_a_torn_line_and_rewrite_cleans_it(tmp_path):
    lines = JsonLines(tmp_path / 'log.jsonl')
    assert lines.read() == []
    lines.append([{'step': 1}, {'step': 2}])
    lines.append([{'step': 3}])
    with open(lines.path, 'a') as f:
        f.write('{"step": 4, "lo')  # a process killed in the middle of an append
    assert lines.read() == [{'step': 1}, {'step': 2}, {'step': 3}]
    lines.rewrite(lines.read()[:2])
    assert (tmp_path / 'log.jsonl').read_text() == '{"step": 1}\n{"step": 2}\n'


def test_replace_dir_swaps_a_whole_folder(tmp_path):
    (tmp_path / 'new').mkdir()
    (tmp_path / 'new' / 'file').write_text('new')
    replace_dir(str(tmp_path / 'new'), str(tmp_path / 'target'))
    (tmp_path / 'newer').mkdir()
    (tmp_path / 'newer' / 'file').write_text('newer')
    replace_dir(str(tmp_path / 'newer'), str(tmp_path / 'target'))
    assert os.listdir(tmp_path) == ['target'] and (tmp_path / 'target' / 'file').read_text() == 'newer'


def test_machine_facts():
    assert cpu_name().strip()
    # The kernel's own high-water mark of this process, in kB (Linux); the two agree up to its counters' lag.
    high_water_mb = next(int(line.split()[1]) / 1024 for line in open('/proc/self/status') if line.startswith('VmHWM:'))
    assert peak_rss_mb() == pytest.approx(high_water_mb, abs=4)
    assert peak_memory_mb(torch.device('cpu')) == peak_rss_mb()
