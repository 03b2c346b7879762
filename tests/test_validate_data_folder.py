"""validate.py --dataset writes into --data-dir only with --dataset-download: a data set whose reader would write there
(Hugging Face's datasets, which caches into the folder it is given; torchvision's ImageNet, which unpacks its archives
there) is refused before it is opened, and the folder is left as it was."""
import os

import pytest

from lipsformer.evaluation.dataset_passes import DataRequest, plan_datasets
from lipsformer.evaluation.errors import EvaluationError
from lipsformer.evaluation.validate_command import main


class _Opened(Exception):
    pass


@pytest.fixture
def opened(monkeypatch) -> list[dict]:
    """The calls of timm's create_dataset (each refused after it is recorded: only whether it was reached counts)."""
    calls = []

    def create_dataset(name, **kwargs):
        calls.append(dict(kwargs, name=name))
        raise _Opened(name)

    monkeypatch.setattr('lipsformer.evaluation.dataset_passes.create_dataset', create_dataset)
    return calls


def _listing(folder) -> list[str]:
    return sorted(os.path.relpath(os.path.join(parent, name), folder) for parent, folders, files in os.walk(folder)
                  for name in folders + files)


def test_a_hugging_face_data_set_is_cached_into_the_data_folder_only_when_asked(tmp_path, opened, capsys):
    data_dir = tmp_path / 'hf'
    assert main(['--model', 'test_vit', '--num-classes', '10', '--dataset', 'hfds/someone/fashion',
                 '--data-dir', str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'Traceback' not in err
    assert f"--dataset hfds/someone/fashion: Hugging Face's datasets downloads and caches it in --data-dir " \
           f"{str(data_dir)!r}" in err
    assert 'nothing is written into a data folder unasked: give --dataset-download to let it' in err
    assert opened == [] and not data_dir.exists()
    with pytest.raises(_Opened):
        plan_datasets(DataRequest(str(data_dir), dataset='hfds/someone/fashion', split='test', download=True))
    assert [(call['name'], call['download']) for call in opened] == [('hfds/someone/fashion', True)]


def test_imagenet_archives_are_unpacked_into_the_data_folder_only_when_asked(tmp_path, opened):
    data_dir = tmp_path / 'imagenet'
    os.makedirs(data_dir)
    for archive in ('ILSVRC2012_devkit_t12.tar.gz', 'ILSVRC2012_img_val.tar'):
        (data_dir / archive).write_bytes(b'archive')
    before = _listing(data_dir)
    with pytest.raises(EvaluationError, match=r"torchvision unpacks ImageNet's archives into --data-dir .* \(meta.bin "
                                              r"and val/, not there yet\) .* give --dataset-download to let it"):
        plan_datasets(DataRequest(str(data_dir), dataset='torch/imagenet', split='validation'))
    assert opened == [] and _listing(data_dir) == before
    (data_dir / 'meta.bin').write_bytes(b'meta')
    os.makedirs(data_dir / 'val')
    with pytest.raises(_Opened):  # unpacked already: read as it is
        plan_datasets(DataRequest(str(data_dir), dataset='torch/imagenet', split='validation'))
    assert len(opened) == 1


def test_a_missing_torchvision_data_set_names_the_option_that_downloads_it(tmp_path, capsys):
    """torchvision's advice ('use download=True') is a Python argument: the error names --dataset-download, and the
    folder that does not exist is not created."""
    data_dir = tmp_path / 'cifar'
    assert main(['--model', 'test_vit', '--num-classes', '10', '--dataset', 'torch/cifar10', '--split', 'test',
                 '--data-dir', str(data_dir)]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'error: --dataset torch/cifar10: cannot open its' in err
    assert err.endswith('; --dataset-download lets torchvision download it there (nothing is written into a data '
                        'folder unasked)\n')
    assert not data_dir.exists()
