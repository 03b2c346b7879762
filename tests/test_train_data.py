"""Training data pieces on their own: sharding that resumes exactly, evaluation that counts every image once,
unreadable images, and Fashion-MNIST from the Debian package's files."""
import gzip
import os

import pytest
import torch
from training_support import make_image_folder, tiny_overrides

from lipsformer.training import load_config
from lipsformer.training.data import (
    DEBIAN_FASHION_MNIST,
    FASHION_MNIST_FILES,
    PAD_INDEX,
    DatasetNotFoundError,
    RobustDataset,
    ShardedEvalSampler,
    ShardedTrainSampler,
    TrainBatches,
    create_split,
    prepare_dataset,
    resolve_input_spec,
)

QUICKSTART = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), 'configs', 'quickstart.yaml')


def test_train_shards_are_disjoint_equal_and_depend_only_on_seed_and_epoch():
    shards = [ShardedTrainSampler(103, num_replicas=4, rank=r, seed=7) for r in range(4)]
    for epoch in (0, 1):
        for sampler in shards:
            sampler.set_epoch(epoch)
        lists = [list(sampler) for sampler in shards]
        assert all(len(indices) == 103 // 4 == len(sampler) for indices, sampler in zip(lists, shards, strict=True))
        merged = sum(lists, [])
        assert len(set(merged)) == len(merged) == 100
        again = ShardedTrainSampler(103, num_replicas=4, rank=2, seed=7)
        again.set_epoch(epoch)
        assert list(again) == lists[2]
    first, second = ShardedTrainSampler(50, seed=1), ShardedTrainSampler(50, seed=1)
    second.set_epoch(1)
    assert list(first) != list(second)


def test_starting_part_way_yields_exactly_the_rest_of_the_epoch():
    sampler = ShardedTrainSampler(40, num_replicas=2, rank=1, seed=3)
    sampler.set_epoch(5)
    whole = list(sampler)
    sampler.set_epoch(5, start=8)
    assert list(sampler) == whole[8:] and len(sampler) == len(whole) - 8


def test_evaluation_covers_every_image_once_with_padding_marked():
    samplers = [ShardedEvalSampler(10, num_replicas=4, rank=r) for r in range(4)]
    lists = [list(sampler) for sampler in samplers]
    assert {len(indices) for indices in lists} == {3}
    real = sorted(i for indices in lists for i in indices if i != PAD_INDEX)
    assert real == list(range(10)) and sum(indices.count(PAD_INDEX) for indices in lists) == 2


def test_resumed_epoch_batches_are_the_unseen_images(tmp_path):
    """Through the real loader (transform, collate, prefetch): batches from k on equal the epoch's batches k..."""
    data_dir = make_image_folder(str(tmp_path / 'images'))
    config = load_config(None, tiny_overrides(data_dir, **{'augment.scale': '[1.0, 1.0]', 'augment.ratio': '[1, 1]',
                                                           'augment.hflip': 0.0, 'augment.color_jitter': 0.0,
                                                           'augment.reprob': 0.0}))
    spec = resolve_input_spec(config)
    batches = TrainBatches(create_split(config, spec, True), config, spec, torch.device('cpu'), 1, 0)
    whole = [images for images, _ in batches.epoch(3)]
    rest = [images for images, _ in batches.epoch(3, start_batch=2)]
    assert len(whole) == len(batches) == 6 and len(rest) == 4
    assert all(torch.equal(a, b) for a, b in zip(whole[2:], rest, strict=True))


def test_unreadable_images_are_replaced_in_training_and_dropped_from_evaluation(tmp_path, caplog):
    class Flaky(torch.utils.data.Dataset):
        def __len__(self):
            return 4

        def __getitem__(self, index):
            if index == 1:
                raise OSError('image file is truncated')
            return f'image{index}', index

        def filename(self, index):
            return f'file{index}.jpg'

    train, val = RobustDataset(Flaky(), is_training=True), RobustDataset(Flaky(), is_training=False)
    assert train[1] == ('image2', 2)
    assert val[1] == ('image2', -1) and val[2] == ('image2', 2) and val[PAD_INDEX] == ('image0', -1)
    assert "skipping unreadable image 'file1.jpg' (index 1): image file is truncated" in caplog.text


def _fake_debian_package(folder):
    os.makedirs(folder)
    for name in FASHION_MNIST_FILES:
        with gzip.open(os.path.join(folder, name + '.gz'), 'wb') as f:
            f.write(name.encode())


def test_fashion_mnist_comes_from_the_debian_package_else_a_clear_message(tmp_path):
    debian = str(tmp_path / 'debian')
    _fake_debian_package(debian)
    root = str(tmp_path / 'data')
    prepare_dataset('torch/fashion_mnist', root, download=False, debian_dir=debian)
    for name in FASHION_MNIST_FILES:
        with open(os.path.join(root, 'FashionMNIST', 'raw', name), 'rb') as f:
            assert f.read() == name.encode()
    with pytest.raises(DatasetNotFoundError, match='apt-get install dataset-fashion-mnist.*data.download=true'):
        prepare_dataset('torch/fashion_mnist', str(tmp_path / 'other'), download=False,
                        debian_dir=str(tmp_path / 'nothing'))
    prepare_dataset('torch/fashion_mnist', str(tmp_path / 'other'), download=True,
                    debian_dir=str(tmp_path / 'nothing'))  # torchvision will download


@pytest.mark.skipif(not os.path.isdir(DEBIAN_FASHION_MNIST), reason='needs the Debian package dataset-fashion-mnist')
def test_quickstart_data_dir_need_not_exist_when_the_debian_package_is_installed(tmp_path):
    """The README's command runs in a fresh clone: data.data_dir is created by unpacking the package."""
    config = load_config(QUICKSTART, [f'data.data_dir={tmp_path / "fresh" / "fashion-mnist"}'])
    spec = resolve_input_spec(config)
    assert len(create_split(config, spec, True)) == 60000 and len(create_split(config, spec, False)) == 10000
