"""Training data pieces on their own: sharding that resumes exactly, evaluation that counts every image once,
unreadable images, and Fashion-MNIST from the Debian package's files."""
import gzip
import logging
import os
import shutil
import subprocess
import sys

import pytest
import torch
from image_data import make_image_folder
from process_support import subprocess_env
from training_support import tiny_overrides

from lipsformer.data import (
    PAD_INDEX,
    DatasetError,
    DatasetNotFoundError,
    RobustDataset,
    class_map_of,
    class_names_of,
    prepare_dataset,
)
from lipsformer.data.fashion_mnist import DEBIAN_FASHION_MNIST, FASHION_MNIST_FILES
from lipsformer.training import load_config
from lipsformer.training.data import (
    ShardedEvalSampler,
    ShardedTrainSampler,
    TrainBatches,
    create_split,
    resolve_input_spec,
)

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
QUICKSTART = os.path.join(REPO, 'configs', 'quickstart.yaml')


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


@pytest.fixture
def tree(data_dir, tmp_path):
    """A copy of the module's image folder tree (train/ and validation/, class_0..class_3) to change."""
    return shutil.copytree(data_dir, tmp_path / 'tree')


def _splits(root, **overrides) -> tuple:
    """The training and validation datasets a run builds from ``root``."""
    config = load_config(None, tiny_overrides(str(root), **overrides))
    spec = resolve_input_spec(config)
    train = create_split(config, spec, True)
    return train, create_split(config, spec, False, class_map=class_map_of(train))


def test_a_split_that_is_not_there_is_an_error_naming_what_is(tree):
    """timm falls back to the whole root: the validation set silently becomes every image, training ones included."""
    shutil.rmtree(tree / 'validation')
    with pytest.raises(DatasetNotFoundError, match=r"data.val_split: no split 'validation' under '.*tree' \(looked "
                                                   r"for validation, val, valid, eval, evaluation, as a folder or a "
                                                   r"\.tar\); it holds train. Set data.val_split"):
        _splits(tree)
    (tree / 'train').rename(tree / 'val')  # the only split, now under a name timm treats as validation
    with pytest.raises(DatasetNotFoundError, match="data.train_split: no split 'train' .* it holds val"):
        _splits(tree)


def test_a_mistyped_split_is_an_error(tree):
    with pytest.raises(DatasetNotFoundError, match="data.train_split: no split 'trian' .*looked for trian, as a .*"
                                                   "it holds train, validation"):
        _splits(tree, **{'data.train_split': 'trian'})
    with pytest.raises(DatasetNotFoundError, match="point data.data_dir at the folder above it"):
        _splits(tree / 'train')  # the class folders of one split given as the dataset root


def test_timm_synonyms_of_a_split_name_are_found_and_said(tree, caplog):
    (tree / 'validation').rename(tree / 'val')
    with caplog.at_level(logging.INFO):
        _, val = _splits(tree)
    assert len(val) == 24 and "data.val_split: 'validation' is not under" in caplog.text


def _labelled(dataset) -> set[tuple[str, int]]:
    """(class folder, label) of every image of a folder dataset."""
    return {(os.path.basename(os.path.dirname(path)), target) for path, target in dataset.dataset.reader.samples}


def test_a_validation_split_without_a_class_is_scored_with_the_training_indices(tree, caplog):
    """timm numbers each split's folders on its own: without class_1, class_2 and class_3 would be labelled 1 and 2."""
    shutil.rmtree(tree / 'validation' / 'class_1')
    with caplog.at_level(logging.INFO):
        train, val = _splits(tree)
    assert class_names_of(train) == ['class_0', 'class_1', 'class_2', 'class_3']
    assert _labelled(val) == {('class_0', 0), ('class_2', 2), ('class_3', 3)} and len(val) == 18
    assert 'has no images of 1 of 4 classes (class_1)' in caplog.text


@pytest.mark.parametrize('change', ['rename', 'extra'])
def test_a_validation_class_the_training_split_lacks_is_an_error(tree, change):
    if change == 'rename':
        (tree / 'validation' / 'class_1').rename(tree / 'validation' / 'class_one')
    else:
        shutil.copytree(tree / 'validation' / 'class_1', tree / 'validation' / 'class_9')
    unknown = 'class_one' if change == 'rename' else 'class_9'
    with pytest.raises(DatasetError, match=f"data.val_split: '.*validation' has class folders that are not among "
                                           f"the training split's classes: {unknown} .the training split's classes: "
                                           f"class_0, class_1, class_2, class_3.. Their images could only be scored "
                                           f"against the wrong labels"):
        _splits(tree)


def test_a_training_class_folder_without_images_is_an_error(tree):
    """timm leaves it out: num_classes shrinks and the validation labels of the classes after it overflow."""
    for image in (tree / 'train' / 'class_2').iterdir():
        image.unlink()
    with pytest.raises(DatasetError, match="data.train_split: class folder.s. class_2 under '.*train' hold no images"):
        _splits(tree)


def test_a_class_map_file_labels_both_splits_and_must_name_every_folder(tree):
    (tree / 'classes.txt').write_text('class_3\nclass_2\nclass_1\nclass_0\n')  # index = line
    train, val = _splits(tree, **{'data.class_map': str(tree / 'classes.txt')})
    assert _labelled(train) == _labelled(val) == {('class_3', 0), ('class_2', 1), ('class_1', 2), ('class_0', 3)}
    (tree / 'classes.txt').write_text('class_0\nclass_1\nclass_2\n')
    with pytest.raises(DatasetError, match='data.train_split: .* are not among the classes of data.class_map: class_3'):
        _splits(tree, **{'data.class_map': str(tree / 'classes.txt')})


def test_a_folder_of_loose_images_is_said_to_be_one(tree):
    """Images straight in the dataset root (no split folder) or in a split folder (no class folders): the message says
    what is there and the layout it needs, not that the folder holds nothing."""
    for image in sorted((tree / 'train').glob('*/*.png')):
        image.rename(tree / 'train' / f'{image.parent.name}-{image.name}')
    for folder in (tree / 'train').iterdir():
        if folder.is_dir():
            folder.rmdir()
    with pytest.raises(DatasetError, match=r"data.train_split: '.*train' holds 48 image\(s\) outside any class folder "
                                           r"\(class_0-00000.png, class_0-00001.png, class_0-00002.png ... \(48 in "
                                           r"all\)\); an image-folder split is <split>/<class>/<image>"):
        _splits(tree)
    with pytest.raises(DatasetNotFoundError, match=r"data.train_split: no split 'train' under '.*train' \(looked for "
                                                   r"train, training, as a folder or a .tar\); it holds 48 image\(s\) "
                                                   r"\(class_0-00000.png, .*\). Set data.train_split to the sub-folder "
                                                   r"to use; an image-folder dataset is <data_dir>/<split>/<class>/"
                                                   r"<image>: put the images into class folders inside a split folder "
                                                   r"\(train/<class>/\)"):
        _splits(tree / 'train')


def test_a_split_without_one_readable_image_is_a_data_problem_and_train_py_exits(tmp_path):
    """Every training image broken, read by a loader worker: exit 2 naming the split (not 1, "please report"), and
    train.py ends (the worker that raised, which ignores SIGTERM, is let go rather than waited for at exit)."""
    data_dir = make_image_folder(str(tmp_path / 'images'))
    for image in (tmp_path / 'images' / 'train').glob('*/*.png'):
        image.write_bytes(b'not a png')
    result = subprocess.run([sys.executable, 'train.py', '--output', str(tmp_path / 'run'), *tiny_overrides(
        data_dir, **{'data.num_workers': 1, 'train.epochs': 1, 'checkpoint.export': False})], cwd=REPO,
        capture_output=True, text=True, timeout=120, env=subprocess_env())
    assert result.returncode == 2, result.stderr[-3000:]
    last = result.stderr.strip().splitlines()[-1]
    assert f"data.train_split 'train' under '{data_dir}': none of its 48 images can be read (the last: " in last
    assert last.endswith('check the files, or point the split at images (exit 2)')
    assert 'please report' not in result.stderr


def test_a_torchvision_split_must_name_its_training_or_test_set(tmp_path):
    """timm gives any name but train/training the test set: data.train_split=trian would train on the test images."""
    config = load_config(QUICKSTART, [f'data.data_dir={tmp_path}', 'data.train_split=trian'])
    with pytest.raises(DatasetNotFoundError, match="data.train_split: 'trian' is not a split of torchvision's "
                                                   "fashion_mnist, which has a training set .train or training. and a "
                                                   "test set .test, or validation, val"):
        create_split(config, resolve_input_spec(config), True)
