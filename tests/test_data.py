"""lipsformer.data: the Fashion-MNIST reader against torchvision's, which reads the same IDX files, and the one image
reader of every split against 8-bit copies of high-bit-depth images."""
import gzip
import logging
import os
import struct
import zlib

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision import transforms
from torchvision.datasets import FashionMNIST

from lipsformer.data import (
    DEBIAN_FASHION_MNIST,
    DatasetNotFoundError,
    DataSource,
    UnreadableImageError,
    open_split,
    prepare_dataset,
    read_fashion_mnist,
    read_idx,
    read_image,
)

needs_fashion_mnist = pytest.mark.skipif(not os.path.isdir(DEBIAN_FASHION_MNIST),
                                         reason='needs the Debian package dataset-fashion-mnist')


@needs_fashion_mnist
def test_fashion_mnist_reads_as_torchvision_reads_it(tmp_path):
    prepare_dataset('torch/fashion_mnist', str(tmp_path), download=False)
    reference = FashionMNIST(str(tmp_path), train=False)
    images, labels = read_fashion_mnist('test')  # the Debian package's gzipped files
    assert images.dtype == torch.uint8 and images.shape == (10000, 28, 28) and labels.dtype == torch.int64
    assert torch.equal(images, reference.data) and torch.equal(labels, reference.targets)
    unpacked, unpacked_labels = read_fashion_mnist('test', str(tmp_path / 'FashionMNIST' / 'raw'))
    assert torch.equal(unpacked, images) and torch.equal(unpacked_labels, labels)


def test_idx_header_gives_the_shape_and_a_short_or_foreign_file_is_refused(tmp_path):
    data = np.arange(24, dtype=np.uint8).reshape(2, 3, 4)
    header = bytes([0, 0, 8, 3]) + b''.join(n.to_bytes(4, 'big') for n in data.shape)
    with gzip.open(tmp_path / 'a.gz', 'wb') as f:
        f.write(header + data.tobytes())
    assert np.array_equal(read_idx(str(tmp_path / 'a.gz')), data)
    (tmp_path / 'short').write_bytes(header + data.tobytes()[:-1])
    with pytest.raises(ValueError, match='needs 24'):
        read_idx(str(tmp_path / 'short'))
    (tmp_path / 'png').write_bytes(b'\x89PNG\r\n\x1a\n')
    with pytest.raises(ValueError, match='not an IDX file'):
        read_idx(str(tmp_path / 'png'))
    with pytest.raises(DatasetNotFoundError, match='apt-get install dataset-fashion-mnist'):
        read_fashion_mnist('train', str(tmp_path))


def _write_png_rgb16(path: str, pixels: np.ndarray) -> None:
    """A 16-bit RGB PNG (Pillow writes none): IHDR bit depth 16, colour type 2, unfiltered rows."""
    height, width, _ = pixels.shape
    rows = b''.join(b'\x00' + row.astype('>u2').tobytes() for row in pixels)

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack('>I', len(data)) + kind + data + struct.pack('>I', zlib.crc32(kind + data))

    header = struct.pack('>IIBBBBB', width, height, 16, 2, 0, 0, 0)
    with open(path, 'wb') as f:
        f.write(b'\x89PNG\r\n\x1a\n' + chunk(b'IHDR', header) + chunk(b'IDAT', zlib.compress(rows))
                + chunk(b'IEND', b''))


def _same_images_in_two_depths(root, colour: bool) -> tuple[str, str]:
    """Two image-folder trees of the same pictures: 8-bit PNGs and their 16-bit copies (each value times 257, which
    a faithful reader maps back to the 8-bit value), grey or RGB."""
    rng = np.random.default_rng(0)
    eight, sixteen = str(root / 'eight'), str(root / 'sixteen')
    for split in ('train', 'validation'):
        for label in range(2):
            for index in range(4):
                pixels = rng.integers(0, 256, (20, 24, 3) if colour else (20, 24), dtype=np.uint8)
                pixels[:, :4] = (0, 255)[label]  # a class-specific band in both extremes
                for tree in (eight, sixteen):
                    os.makedirs(os.path.join(tree, split, f'class_{label}'), exist_ok=True)
                name = os.path.join(split, f'class_{label}', f'{index}.png')
                Image.fromarray(pixels).save(os.path.join(eight, name))
                wide = pixels.astype(np.uint16) * 257
                if colour:
                    _write_png_rgb16(os.path.join(sixteen, name), wide)
                else:
                    Image.fromarray(wide).save(os.path.join(sixteen, name))
    return eight, sixteen


@pytest.mark.parametrize('colour', [False, True], ids=['grey16', 'rgb16'])
def test_sixteen_bit_images_read_as_their_eight_bit_copies_everywhere(tmp_path, colour):
    """Training's splits, validate.py's images and the stability experiment's subsets read a 16-bit PNG as its 8-bit
    copy (Pillow's own conversion clips 16-bit grey to 0..255: nearly black and white)."""
    from lipsformer.evaluation.dataset_passes import DataRequest, open_named_dataset
    from lipsformer.evaluation.predict import EvalImageDataset
    from lipsformer.instruments.stability.subsets import load_image_folder
    eight, sixteen = _same_images_in_two_depths(tmp_path, colour)
    with Image.open(os.path.join(sixteen, 'train', 'class_0', '0.png')) as image:
        assert image.mode in (('RGB',) if colour else ('I;16', 'I'))  # 'I': how Pillow before 10.4 opens them
    for in_chans in (1, 3):
        def split_tensors(root: str) -> torch.Tensor:
            dataset = open_split(DataSource(data_dir=root, in_chans=in_chans), 'train', 'data.train_split', True,
                                 transforms.PILToTensor())
            return torch.stack([dataset[i][0] for i in range(len(dataset))])
        training = split_tensors(eight)
        assert training.shape[1] == in_chans and training.float().std() > 50
        assert torch.equal(split_tensors(sixteen), training)

        data_config = dict(input_size=(in_chans, 16, 16), interpolation='bilinear', mean=(0.5,) * in_chans,
                           std=(0.5,) * in_chans, crop_pct=1.0, crop_mode='center')
        names = sorted(os.path.join('validation', label, name) for label in ('class_0', 'class_1')
                       for name in os.listdir(os.path.join(eight, 'validation', label)))
        evaluated = [EvalImageDataset([os.path.join(root, name) for name in names], data_config) for root in
                     (eight, sixteen)]
        for index in range(len(names)):
            (image8, *_, readable8), (image16, *_, readable16) = evaluated[0][index][:3], evaluated[1][index][:3]
            assert readable8 and readable16 and torch.equal(image16, image8)
        named = [open_named_dataset(DataRequest(root, 'imagenet', dataset='folder', split='validation'))
                 for root in (eight, sixteen)]  # validate.py --dataset: timm's create_dataset
        evaluated = [EvalImageDataset(images.paths, data_config, source=images.source) for images in named]
        assert all(torch.equal(evaluated[0][i][0], evaluated[1][i][0]) for i in range(len(named[0].paths)))
    subsets8, subsets16 = (load_image_folder(root, 16, 8, 8) for root in (eight, sixteen))
    assert subsets8.in_chans == (3 if colour else 1)
    assert torch.equal(subsets16.train_images, subsets8.train_images)
    assert torch.equal(subsets16.test_images, subsets8.test_images)


def test_an_image_of_unknown_range_is_refused_with_its_file_named(tmp_path, caplog):
    path = str(tmp_path / 'float.tiff')
    Image.fromarray(np.full((8, 8), 0.5, dtype=np.float32)).save(path)
    with pytest.raises(UnreadableImageError, match=rf"{path!r} holds floating-point pixels \(Pillow mode 'F'\)"):
        read_image(path, 'L')
    from lipsformer.evaluation.predict import EvalImageDataset
    data_config = dict(input_size=(1, 8, 8), interpolation='bilinear', mean=(0.5,), std=(0.5,), crop_pct=1.0,
                       crop_mode='center')
    with caplog.at_level(logging.WARNING, logger='lipsformer'):
        image, _, readable, _ = EvalImageDataset([path], data_config)[0]
    assert not readable and not image.any()
    assert f'skipping unreadable image {path}: {path!r} holds floating-point pixels' in caplog.text


def test_training_splits_read_tiffs_and_name_the_files_they_leave_out(tmp_path, caplog):
    """An image-folder split reads TIFFs (16-bit grey scaled as its 8-bit copy) as timm's folder reader reads PNGs;
    a file of another type, or a link that points nowhere, is named in a warning as skipped."""
    rng = np.random.default_rng(0)
    expected = {}
    for label in range(2):
        folder = tmp_path / 'train' / f'class_{label}'
        os.makedirs(folder)
        for index, suffix in enumerate(('.png', '.tif', '.TIFF')):
            pixels = rng.integers(0, 256, (8, 8), dtype=np.uint8)
            wide = suffix == '.TIFF'
            Image.fromarray(pixels.astype(np.uint16) * 257 if wide else pixels).save(folder / f'{index}{suffix}')
            expected[f'class_{label}/{index}{suffix}'] = (torch.from_numpy(pixels), label)
    (tmp_path / 'train' / 'class_0' / 'notes.txt').write_text('not an image')
    os.symlink(tmp_path / 'nowhere.dat', tmp_path / 'train' / 'class_1' / 'gone.dat')
    with caplog.at_level(logging.WARNING, logger='lipsformer.data.sources'):
        dataset = open_split(DataSource(data_dir=str(tmp_path), in_chans=1), 'train', 'data.train_split', True,
                             transforms.PILToTensor())
    assert len(dataset) == 6
    for index in range(len(dataset)):
        name = os.path.relpath(dataset.dataset.filename(index, absolute=True), tmp_path / 'train')
        image, label = dataset[index]
        assert label == expected[name][1] and torch.equal(image[0], expected[name][0])
    assert "skipping 2 file(s) under" in caplog.text
    assert 'class_0/notes.txt, class_1/gone.dat' in caplog.text
