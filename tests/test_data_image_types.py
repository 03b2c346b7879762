"""Every image type the docs name is read from an image-folder split, as a folder or as a ``.tar``, by training and by
validate.py's ``--dataset``; every file that is not read is named as skipped."""
import io
import logging
import os
import tarfile

import numpy as np
import pytest
from PIL import Image
from torchvision import transforms

from lipsformer.data import DataSource, open_split, read_image
from lipsformer.data.datasets import class_map_of
from lipsformer.data.images import IMAGE_EXTENSIONS
from lipsformer.evaluation.dataset_passes import DataRequest, plan_datasets

# One file name per type docs/evaluation.md names, in mixed case (the reader ignores the case of an extension).
_NAMES = ('0.png', '1.JPG', '2.jpeg', '3.tif', '4.TIFF', '5.bmp', '6.pgm', '7.ppm', '8.webp')


def _write_split(folder, num_classes: int = 2) -> dict[tuple[int, bytes], int]:
    """``folder/class_<k>/<name>`` for every name of :data:`_NAMES`, and each image's pixels (as ``L``, read back
    from the file, so that JPEG's loss does not matter) with its class; plus a text file and a dangling link."""
    rng = np.random.default_rng(0)
    expected: dict[tuple[int, bytes], int] = {}
    for label in range(num_classes):
        os.makedirs(folder / f'class_{label}')
        for name in _NAMES:
            path = folder / f'class_{label}' / name
            pixels = rng.integers(0, 256, (8, 8), dtype=np.uint8)
            Image.fromarray(pixels).save(path, **({'lossless': True} if name.endswith('webp') else {}))
            with Image.open(path) as image:
                key = (label, np.asarray(read_image(image, 'L')).tobytes())
            expected[key] = expected.get(key, 0) + 1
    (folder / 'class_0' / 'notes.txt').write_text('not an image')
    return expected


def _read_all(dataset) -> dict[tuple[int, bytes], int]:
    found: dict[tuple[int, bytes], int] = {}
    for index in range(len(dataset)):
        image, label = dataset[index]
        key = (int(label), image[0].numpy().tobytes())
        found[key] = found.get(key, 0) + 1
    return found


def test_the_docs_name_every_type_the_reader_reads():
    docs = open(os.path.join(os.path.dirname(__file__), '..', 'docs', 'evaluation.md')).read()
    assert {os.path.splitext(name)[1].lower() for name in _NAMES} == IMAGE_EXTENSIONS
    named = docs.split('Image files are ')[1].split(' (any case)')[0]
    assert {part.strip(' `,') for part in named.replace(' and ', ', ').split(', ')} == IMAGE_EXTENSIONS


@pytest.mark.parametrize('container', ['folder', 'tar'])
def test_a_training_split_reads_every_image_type_and_names_what_it_leaves_out(tmp_path, caplog, container):
    expected = _write_split(tmp_path / 'images')
    if container == 'folder':
        os.rename(tmp_path / 'images', tmp_path / 'train')
        os.symlink(tmp_path / 'nowhere.dat', tmp_path / 'train' / 'class_1' / 'gone.dat')
    else:
        with tarfile.open(tmp_path / 'train.tar', 'w') as tar:
            for name in sorted(os.listdir(tmp_path / 'images')):
                tar.add(tmp_path / 'images' / name, arcname=name)
            link = tarfile.TarInfo('class_1/gone.png')
            link.type, link.linkname = tarfile.SYMTYPE, '../nowhere.png'
            tar.addfile(link)
    with caplog.at_level(logging.WARNING, logger='lipsformer.data.sources'):
        dataset = open_split(DataSource(data_dir=str(tmp_path), in_chans=1), 'train', 'data.train_split', True,
                             transforms.PILToTensor())
    assert len(dataset) == 2 * len(_NAMES)
    assert _read_all(dataset) == expected
    left_out = 'class_0/notes.txt, class_1/gone.dat' if container == 'folder' else 'class_0/notes.txt, class_1/gone.png'
    assert 'skipping 2 file(s) under' in caplog.text and left_out in caplog.text


def test_validate_dataset_of_class_folders_reads_every_type_and_names_what_it_leaves_out(tmp_path):
    """--dataset torch/image_folder: every type is read, and the files it leaves out are the pass's skipped."""
    expected = _write_split(tmp_path / 'data')
    dangling = tmp_path / 'data' / 'class_1' / 'gone.dat'
    os.symlink(tmp_path / 'nowhere.dat', dangling)
    (planned,) = plan_datasets(DataRequest(str(tmp_path / 'data'), dataset='torch/image_folder', split='validation'))
    assert len(planned.images.paths) == 2 * len(_NAMES)
    assert planned.images.left_out == (str(tmp_path / 'data' / 'class_0' / 'notes.txt'), str(dangling))
    source = planned.images.source
    found = {}
    for index in range(len(source)):
        image, label = source[index]
        key = (label, np.asarray(read_image(image, 'L')).tobytes())
        found[key] = found.get(key, 0) + 1
    assert found == expected


def test_torchvisions_image_folder_scales_sixteen_bit_images_as_the_packages_reader_does(tmp_path):
    """data.dataset / --dataset torch/image_folder: a 16-bit TIFF reads as its 8-bit copy (each value v stored as
    v * 257), not clipped to white by torchvision's own loader, in training and in validate.py alike."""
    rng = np.random.default_rng(1)
    expected = {}
    for label in range(2):
        os.makedirs(tmp_path / 'train' / f'class_{label}')
        pixels = rng.integers(0, 256, (8, 8), dtype=np.uint8)
        Image.fromarray(pixels.astype(np.uint16) * 257).save(tmp_path / 'train' / f'class_{label}' / 'wide.tif')
        expected[label] = pixels
    dataset = open_split(DataSource(dataset='torch/image_folder', data_dir=str(tmp_path), in_chans=1), 'train',
                         'data.train_split', True, transforms.PILToTensor())
    assert len(dataset) == 2
    for index in range(2):
        image, label = dataset[index]
        assert np.array_equal(image[0].numpy(), expected[label])
    (planned,) = plan_datasets(DataRequest(str(tmp_path / 'train'), dataset='torch/image_folder', split='validation'))
    for index in range(2):
        image, label = planned.images.source[index]
        assert np.array_equal(np.asarray(read_image(image, 'L')), expected[label])


def test_an_unreadable_file_of_torchvisions_image_folder_is_named_when_skipped(tmp_path, caplog):
    os.makedirs(tmp_path / 'train' / 'class_0')
    Image.fromarray(np.zeros((8, 8), dtype=np.uint8)).save(tmp_path / 'train' / 'class_0' / 'black.png')
    os.symlink(tmp_path / 'nowhere.png', tmp_path / 'train' / 'class_0' / 'gone.png')
    dataset = open_split(DataSource(dataset='torch/image_folder', data_dir=str(tmp_path), in_chans=1), 'train',
                         'data.train_split', True, transforms.PILToTensor())
    with caplog.at_level(logging.WARNING, logger='lipsformer.data.datasets'):
        image, label = dataset[1]
    assert label == 0 and dataset.skipped_images() == 1
    assert f"skipping unreadable image {str(tmp_path / 'train' / 'class_0' / 'gone.png')!r} (index 1)" in caplog.text


def _add_image(tar: tarfile.TarFile, name: str, value: int) -> None:
    """A member ``name`` (taken as it is: tar.add would strip a leading /) holding an 8x8 PNG of one gray value."""
    buffer = io.BytesIO()
    Image.fromarray(np.full((8, 8), value, dtype=np.uint8)).save(buffer, format='PNG')
    member = tarfile.TarInfo(name)
    member.size = len(buffer.getvalue())
    tar.addfile(member, io.BytesIO(buffer.getvalue()))


def test_tar_members_whose_paths_lead_outside_are_skipped_named_and_make_no_class(tmp_path, caplog):
    """``../../outside/escaped.png`` would be a class ``outside`` and ``/outside/bag/abs.png`` an image of ``bag``
    (timm labels a member by the folder above it); both are skipped and named, in the training split and in an
    evaluation split labelled with the training split's classes."""
    for split, extra in (('train', ['../../outside/escaped.png', '/outside/bag/abs.png']),
                         ('validation', ['../bag/up.png', '/shoe/abs.png'])):
        with tarfile.open(tmp_path / f'{split}.tar', 'w') as tar:
            for value, name in enumerate(['bag/0.png', 'bag/1.png', 'shoe/0.png', *extra, 'shoe/1.png']):
                _add_image(tar, name, 255 if name in extra else value)
    source = DataSource(data_dir=str(tmp_path), in_chans=1)
    with caplog.at_level(logging.WARNING, logger='lipsformer.data.sources'):
        train = open_split(source, 'train', 'data.train_split', True, transforms.PILToTensor())
    assert class_map_of(train) == {'bag': 0, 'shoe': 1}
    assert sorted(train.dataset.reader.class_idx_to_name.items()) == [(0, 'bag'), (1, 'shoe')]
    assert [member.name for member, _, _ in train.dataset.reader.samples] == ['bag/0.png', 'bag/1.png', 'shoe/0.png',
                                                                             'shoe/1.png']
    assert [int(label) for _, label in (train[i] for i in range(len(train)))] == [0, 0, 1, 1]
    assert all(int(image.max()) < 255 for image, _ in (train[i] for i in range(len(train))))  # none read
    assert (f"data.train_split: skipping 2 member(s) of {str(tmp_path / 'train.tar')!r} whose paths lead out of the "
            f"archive (absolute, or with ..): ../../outside/escaped.png, /outside/bag/abs.png; they are not read and "
            f"make no class") in caplog.text
    assert 'that are not images' not in caplog.text  # each skipped member is named once
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger='lipsformer.data.sources'):
        validation = open_split(source, 'validation', 'data.val_split', False, transforms.PILToTensor(),
                                class_map=class_map_of(train))
    assert [(member.name, int(label)) for (member, _, _), label in zip(validation.dataset.reader.samples,
                                                                       validation.dataset.reader.targets)] == [
        ('bag/0.png', 0), ('bag/1.png', 0), ('shoe/0.png', 1), ('shoe/1.png', 1)]
    assert 'skipping 2 member(s)' in caplog.text and '../bag/up.png, /shoe/abs.png' in caplog.text
