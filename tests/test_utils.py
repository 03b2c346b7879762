"""lipsformer.utils: writes that leave the old file or the new one whatever happens, JSON lines, machine facts."""
import argparse
import errno
import logging
import os
import signal
import stat

import pytest
import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from storage_faults import read_only

import lipsformer.utils.env as env
import lipsformer.utils.io as io_module
from lipsformer.utils import (
    JsonLines,
    atomic_open,
    cpu_details,
    cpu_name,
    peak_memory_mb,
    peak_rss_mb,
    read_json,
    remove_stale_temporaries,
    replace_dir,
    save_safetensors,
    save_torch,
    write_json,
)
from lipsformer.utils.io import write_text


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
    umask = os.umask(0o022)
    os.umask(umask)
    for name in ('model.safetensors', 'state.pt'):  # what open() gives (safetensors from 0.5 makes its files 0600)
        assert stat.S_IMODE(os.stat(tmp_path / name).st_mode) == 0o666 & ~umask == io_module.default_file_mode()


def test_a_write_into_a_read_only_folder_raises_its_own_error_not_the_clean_up_s(tmp_path):
    """The temporary file was never made, and removing it fails as well on a read-only file system; the error
    raised is the write's, with nothing chained to it."""
    with read_only(str(tmp_path)), pytest.raises(OSError) as caught:
        write_text(tmp_path / 'notes.txt', 'text')
    assert caught.value.errno in (errno.EROFS, errno.EACCES)
    assert os.path.basename(caught.value.filename).startswith('.notes.txt.tmp-')
    assert caught.value.__context__ is None and os.listdir(tmp_path) == []


# What safetensors says when the disk is full (measured on a full tmpfs): 0.4.x, and 0.5 on.
SAFETENSORS_DISK_FULL = ['Error while serializing: IoError(Os { code: 28, kind: StorageFull, message: "No space left '
                         'on device" })', 'Error while serializing: I/O error: No space left on device (os error 28)']


@pytest.mark.parametrize('message', SAFETENSORS_DISK_FULL, ids=['0.4', '0.5+'])
def test_safetensors_disk_full_error_is_an_os_error(tmp_path, monkeypatch, message):
    """safetensors reports the system's error only in its message; the write raises the OSError it names."""
    def full_disk(tensors, path):
        with open(path, 'wb') as f:
            f.write(b'partial')
        raise SafetensorError(message)
    monkeypatch.setattr(io_module, 'save_file', full_disk)
    with pytest.raises(OSError, match=r'\[Errno 28\] No space left on device') as caught:
        save_safetensors({'w': torch.zeros(3)}, tmp_path / 'model.safetensors')
    assert caught.value.errno == errno.ENOSPC and caught.value.filename == str(tmp_path / 'model.safetensors')
    assert isinstance(caught.value.__cause__, SafetensorError) and os.listdir(tmp_path) == []


@pytest.mark.skipif(not os.path.exists('/dev/full'), reason='needs /dev/full, where every write fails with ENOSPC')
def test_torch_disk_full_error_holds_the_os_error_it_met(tmp_path, monkeypatch):
    """torch.save into a file object that cannot be written (/dev/full): torch's "enforce fail" error, or the
    OSError of the file's close, holds the system's error in its chain."""
    monkeypatch.setattr(io_module, '_temporary_path', lambda path: _symlink_to_dev_full(path + '.tmp'))
    with pytest.raises(Exception) as caught:
        save_torch({'w': torch.zeros(100_000)}, tmp_path / 'optimizer.pt')
    found = io_module.os_error_in_chain(caught.value)
    assert found is not None and found.errno == errno.ENOSPC and found.strerror == 'No space left on device'
    assert os.listdir(tmp_path) == []  # the link to /dev/full removed like any temporary file
    assert io_module.os_error_in_chain(RuntimeError('a bug')) is None
    assert io_module.os_error_in_chain(RuntimeError('a bug', OSError('no errno'))) is None


def _symlink_to_dev_full(path: str) -> str:
    os.symlink('/dev/full', path)
    return path


def test_json_lines_stop_at_a_torn_line_say_so_and_rewrite_cleans_it(tmp_path, caplog):
    lines = JsonLines(tmp_path / 'log.jsonl')
    assert lines.read() == []
    lines.append([{'step': 1}, {'step': 2}])
    lines.append([{'step': 3}])
    with open(lines.path, 'a') as f:
        f.write('{"step": 4, "lo')  # a process killed in the middle of an append
    with caplog.at_level(logging.WARNING):
        assert lines.read() == [{'step': 1}, {'step': 2}, {'step': 3}]
    assert 'log.jsonl: line 4 is not a whole JSON record (\'{"step": 4, "lo\'); it and the 0 line(s)' in caplog.text
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


def _folder(path, content: str) -> str:
    path.mkdir()
    (path / 'file').write_text(content)
    return str(path)


class _Killed(BaseException):
    """What a SIGKILL does to a process, as far as the files it was writing are concerned."""


def _killed_after_first_rename(monkeypatch) -> None:
    rename = os.rename
    calls = []

    def rename_then_die(*args):
        if calls:
            raise _Killed
        calls.append(args)
        rename(*args)
    monkeypatch.setattr(os, 'rename', rename_then_die)


def test_replacing_a_folder_is_one_step(tmp_path, monkeypatch):
    """A kill at any point of a replacement leaves the target whole: the old folder or the new one."""
    target = _folder(tmp_path / 'target', 'old')
    with monkeypatch.context() as patch:
        _killed_after_first_rename(patch)
        replace_dir(_folder(tmp_path / '.tmp-target', 'new'), target)
    assert os.listdir(tmp_path) == ['target'] and (tmp_path / 'target' / 'file').read_text() == 'new'


def test_without_an_atomic_swap_a_killed_replacement_is_undone_at_the_next_start(tmp_path, monkeypatch):
    target = _folder(tmp_path / 'target', 'old')
    monkeypatch.setattr(io_module, '_exchange', lambda first, second: False)  # e.g. NFS
    with monkeypatch.context() as patch, pytest.raises(_Killed):
        _killed_after_first_rename(patch)
        replace_dir(_folder(tmp_path / '.tmp-target', 'new'), target)
    assert not os.path.exists(target)
    (tmp_path / '.summary.json.tmp-1234-a1b2c3').write_text('{"half')  # a killed atomic_open
    (tmp_path / 'keep.json').write_text('{}')
    assert remove_stale_temporaries(str(tmp_path)) == ['.old-target', '.summary.json.tmp-1234-a1b2c3', '.tmp-target']
    assert sorted(os.listdir(tmp_path)) == ['keep.json', 'target']
    assert (tmp_path / 'target' / 'file').read_text() == 'old'
    replace_dir(_folder(tmp_path / '.tmp-target', 'new'), target)
    assert (tmp_path / 'target' / 'file').read_text() == 'new'


def test_a_folder_removal_killed_midway_leaves_no_partial_folder_under_its_name(tmp_path, monkeypatch):
    """A checkpoint pruned while the process is killed must not stay behind with its meta file and without its
    weights: the folder goes away whole, and what the kill left is cleared at the next start."""
    checkpoint = tmp_path / 'step_00000016'
    checkpoint.mkdir()
    for name in ('meta.json', 'model.safetensors', 'optimizer.bin'):
        (checkpoint / name).write_text(name)
    rmtree = io_module.shutil.rmtree

    def delete_one_file_then_die(path, ignore_errors=False):
        if not os.path.exists(path):
            return rmtree(path, ignore_errors=ignore_errors)
        os.remove(os.path.join(path, 'model.safetensors'))
        raise _Killed

    with monkeypatch.context() as patch, pytest.raises(_Killed):
        patch.setattr(io_module.shutil, 'rmtree', delete_one_file_then_die)
        io_module.remove_dir(str(checkpoint))
    assert os.listdir(tmp_path) == ['.tmp-removed-step_00000016']
    assert remove_stale_temporaries(str(tmp_path)) == ['.tmp-removed-step_00000016'] and not os.listdir(tmp_path)
    checkpoint.mkdir()
    io_module.remove_dir(str(checkpoint))
    assert not os.listdir(tmp_path)


def test_renames_are_flushed_with_their_folder(tmp_path, monkeypatch):
    """The folder entry is flushed after the rename that makes a file or folder visible (best.json, summary.json,
    exports), or a power cut can lose the rename."""
    flushed = []
    fsync_file = io_module._fsync_file
    monkeypatch.setattr(io_module, '_fsync_file', lambda path: (flushed.append(path), fsync_file(path)))
    write_json(tmp_path / 'best.json', {'a': 1})
    assert flushed[-1] == str(tmp_path) and os.path.basename(flushed[-2]).startswith('.best.json.tmp-')
    flushed.clear()
    replace_dir(_folder(tmp_path / '.tmp-export', 'x'), str(tmp_path / 'export'))
    assert flushed == [str(tmp_path / '.tmp-export' / 'file'), str(tmp_path / '.tmp-export'), str(tmp_path)]


def test_machine_facts():
    assert cpu_name().strip()
    # The kernel's own high-water mark of this process, in kB (Linux); the two agree up to its counters' lag.
    high_water_mb = next(int(line.split()[1]) / 1024 for line in open('/proc/self/status') if line.startswith('VmHWM:'))
    assert peak_rss_mb() == pytest.approx(high_water_mb, abs=4)
    assert peak_memory_mb(torch.device('cpu')) == peak_rss_mb()


def test_cpu_details_tell_generations_apart(tmp_path, monkeypatch):
    details = cpu_details()
    assert details['name'] == cpu_name() and details['isa'] == torch.backends.cpu.get_cpu_capability()
    cpuinfo = tmp_path / 'cpuinfo'  # two processors of a Zen 5 guest: only the first block is read
    cpuinfo.write_text('processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 26\nmodel\t\t: 2\n'
                       'model name\t: AMD EPYC\nstepping\t: 1\n\nprocessor\t: 1\ncpu family\t: 25\n')
    real_path = env.Path
    monkeypatch.setattr(env, 'Path', lambda path: cpuinfo if path == '/proc/cpuinfo' else real_path(path))
    assert env.cpu_details() == {'name': 'AMD EPYC', 'vendor': 'AuthenticAMD', 'family': '26', 'model': '2',
                                 'stepping': '1', 'isa': torch.backends.cpu.get_cpu_capability()}


def test_usage_error_is_one_line_naming_the_command(capsys):
    """An error found after parsing is one line, PROG: error: MESSAGE, with exit 2 (argparse's own errors print the
    usage block above theirs); the stability experiment's conflicting options end that way."""
    from lipsformer.instruments.stability import experiment_command
    from lipsformer.utils.cli import usage_error
    parser = argparse.ArgumentParser(prog='lipsformer-tool')
    parser.add_argument('--size', type=int)
    with pytest.raises(SystemExit) as stopped:
        usage_error(parser, '--size must be a multiple of 32, got 50')
    assert stopped.value.code == 2
    assert capsys.readouterr().err == 'lipsformer-tool: error: --size must be a multiple of 32, got 50\n'
    with pytest.raises(SystemExit) as stopped:
        experiment_command.main(['--out', 'runs', '--data-dir', 'images', '--synthetic'])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines() == [
        'python -m lipsformer.instruments.stability: error: --data-dir and --synthetic exclude each other']


def test_ctrl_c_deferred_delivers_a_ctrl_c_after_the_block():
    """A SIGINT inside the block lets the block finish, then raises KeyboardInterrupt; the handler is restored."""
    from lipsformer.utils.cli import ctrl_c_deferred
    finished = []
    with pytest.raises(KeyboardInterrupt):
        with ctrl_c_deferred():
            os.kill(os.getpid(), signal.SIGINT)
            finished.append(True)
    assert finished == [True] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    with ctrl_c_deferred():  # nothing held back: nothing raised
        finished.append(True)
