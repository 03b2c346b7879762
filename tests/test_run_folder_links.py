"""A run writes its files only inside its run folder: a run file or folder that is a symbolic link (a ``train.log``
pointing at a file elsewhere, an ``export`` pointing at another folder) is refused before anything is written, with
one line naming each link and what to do."""
import os

import pytest
from training_support import tiny_overrides

from lipsformer.training.train_command import main

pytestmark = pytest.mark.usefixtures('one_thread')


def test_run_files_that_are_links_out_of_the_run_folder_are_refused(data_dir, tmp_path, caplog):
    outside = tmp_path / 'outside'
    (outside / 'exports').mkdir(parents=True)
    (outside / 'notes.log').write_text('my own log\n')
    run_dir = tmp_path / 'run'
    run_dir.mkdir()
    os.symlink(outside / 'notes.log', run_dir / 'train.log')
    os.symlink(outside / 'exports', run_dir / 'export')
    assert main([*tiny_overrides(data_dir, **{'train.epochs': 1}), '--output', str(run_dir)]) == 2
    (error,) = [record.getMessage() for record in caplog.records if record.levelname == 'ERROR']
    links = f"{run_dir / 'train.log'} -> {outside / 'notes.log'}, {run_dir / 'export'} -> {outside / 'exports'}"
    assert error == (f"ConfigError: --output {str(run_dir)!r}: {links} are symbolic links, and a run writes its files "
                     f"only inside its folder, never through a link out of it. Remove the links (copying what they "
                     f"point to into the folder, to keep it), or choose another --output (exit 2)")
    assert (outside / 'notes.log').read_text() == 'my own log\n' and os.listdir(outside / 'exports') == []
    assert sorted(name for name in os.listdir(run_dir) if not name.startswith('.')) == ['export', 'train.log']
