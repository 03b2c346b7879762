"""lipsformer.data's Fashion-MNIST reader against torchvision's, which reads the same IDX files."""
import gzip
import os

import numpy as np
import pytest
import torch
from torchvision.datasets import FashionMNIST

from lipsformer.data import DEBIAN_FASHION_MNIST, DatasetNotFoundError, prepare_dataset, read_fashion_mnist, read_idx

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
