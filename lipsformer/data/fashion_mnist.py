"""Fashion-MNIST from its IDX files: the one reader of them, and the files torchvision expects, unpacked offline.

The Debian package ``dataset-fashion-mnist`` ships the four gzipped IDX files in :data:`DEBIAN_FASHION_MNIST`.
:func:`read_fashion_mnist` reads one split from such a folder (gzipped or not) as tensors; :func:`prepare_dataset`
unpacks them where torchvision's ``FashionMNIST(root)`` (timm's ``torch/fashion_mnist``) looks, so that no network is
needed.
"""
import gzip
import logging
import os
import shutil

import numpy as np
import torch

from ..utils.io import atomic_open
from .splits import DatasetNotFoundError

__all__ = ['DEBIAN_FASHION_MNIST', 'FASHION_MNIST_FILES', 'prepare_dataset', 'read_fashion_mnist', 'read_idx']

_logger = logging.getLogger(__name__)

DEBIAN_FASHION_MNIST = '/usr/share/datasets/fashion-mnist'

FASHION_MNIST_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
                       't10k-labels-idx1-ubyte')


def read_idx(path: str) -> np.ndarray:
    """An IDX file (gzipped when its name ends in ``.gz``) as a uint8 array of the shape its header gives.

    Raises:
        ValueError: The file is not an IDX file of unsigned bytes, or is shorter than its header says.
    """
    with (gzip.open if path.endswith('.gz') else open)(path, 'rb') as f:
        data = f.read()
    if len(data) < 4 or data[:2] != b'\0\0' or data[2] != 0x08:
        raise ValueError(f'{path} is not an IDX file of unsigned bytes (magic {data[:4].hex()!r}, expected 000008xx)')
    dims = data[3]
    shape = [int.from_bytes(data[4 + 4 * i:8 + 4 * i], 'big') for i in range(dims)]
    offset, size = 4 + 4 * dims, int(np.prod(shape))
    if len(data) < offset + size:
        raise ValueError(f'{path} holds {len(data) - offset} bytes of data; its header {shape} needs {size}')
    return np.frombuffer(data, dtype=np.uint8, count=size, offset=offset).reshape(shape)


def read_fashion_mnist(split: str, folder: str = DEBIAN_FASHION_MNIST) -> tuple[torch.Tensor, torch.Tensor]:
    """One split of Fashion-MNIST from the IDX files in ``folder`` (gzipped, as Debian ships them, or unpacked).

    Args:
        split: ``train`` (60000 images) or ``test`` (10000).
        folder: The folder of the IDX files (the Debian package's, or a torchvision root's ``FashionMNIST/raw``).

    Returns:
        (N, 28, 28) uint8 images and (N,) int64 labels.

    Raises:
        DatasetNotFoundError: The split's files are not in ``folder``.
    """
    if split not in ('train', 'test'):
        raise ValueError(f"split {split!r}: Fashion-MNIST has 'train' and 'test'")
    prefix = 'train' if split == 'train' else 't10k'
    arrays = []
    for kind in ('images-idx3-ubyte', 'labels-idx1-ubyte'):
        path = os.path.join(folder, f'{prefix}-{kind}')
        path = path if os.path.isfile(path) else path + '.gz'
        if not os.path.isfile(path):
            raise DatasetNotFoundError(
                f'Fashion-MNIST {split} files ({prefix}-{kind}[.gz]) not in {folder}: install the Debian package '
                f'(apt-get install dataset-fashion-mnist, files in {DEBIAN_FASHION_MNIST}) or give their folder')
        arrays.append(torch.from_numpy(read_idx(path).copy()))
    return arrays[0], arrays[1].long()


def prepare_dataset(name: str, root: str | None, download: bool, debian_dir: str = DEBIAN_FASHION_MNIST,
                    unpack: bool = True, download_option: str = 'set data.download=true') -> None:
    """Make a torchvision dataset readable offline when a local copy exists.

    torchvision's ``FashionMNIST(root)`` reads the four uncompressed IDX files from ``<root>/FashionMNIST/raw``; the
    Debian package ``dataset-fashion-mnist`` ships them gzipped in :data:`DEBIAN_FASHION_MNIST`, from where they are
    unpacked into the root.

    Args:
        name: The config's ``data.dataset``; only ``torch/fashion_mnist`` needs preparing.
        root: The dataset root (``data.data_dir``).
        download: Whether torchvision may download what is missing.
        debian_dir: Where the Debian package keeps its gzipped IDX files.
        unpack: Whether the Debian package's copy may be unpacked into ``root`` (training's data folder is its own
            to fill; validate.py writes into one only when asked to download).
        download_option: What lets the command download, for the message (``--dataset-download``).

    Raises:
        DatasetNotFoundError: Fashion-MNIST is not in the root and may neither be unpacked there from the Debian
            package nor downloaded.
    """
    if name.lower() != 'torch/fashion_mnist':
        return
    if root is None:
        raise DatasetNotFoundError('data.data_dir is not set; give the folder Fashion-MNIST lives in (or should be '
                                   'unpacked / downloaded to) with --data-dir or data.data_dir=PATH')
    raw_dir = os.path.join(root, 'FashionMNIST', 'raw')
    missing = [f for f in FASHION_MNIST_FILES if not os.path.isfile(os.path.join(raw_dir, f))]
    if not missing:
        return
    packaged = [os.path.join(debian_dir, f + '.gz') for f in missing]
    if not unpack and not download:
        where = f'{root!r} does not exist' if not os.path.isdir(root) else f'{raw_dir!r} lacks {", ".join(missing)}'
        local = (f'unpacks the copy of the Debian package ({debian_dir}) there' if all(map(os.path.isfile, packaged))
                 else 'lets torchvision download it there')
        raise DatasetNotFoundError(f'Fashion-MNIST is not in the data folder: {where}. Nothing is written into a data '
                                   f'folder unasked: {download_option} {local}, or give the folder that holds '
                                   f'FashionMNIST/raw')
    if all(os.path.isfile(p) for p in packaged):
        _logger.info('unpacking Fashion-MNIST from %s into %s', debian_dir, raw_dir)
        os.makedirs(raw_dir, exist_ok=True)
        for name_, source in zip(missing, packaged, strict=True):
            _gunzip_atomically(source, os.path.join(raw_dir, name_))
        return
    if download:
        return
    raise DatasetNotFoundError(
        f'Fashion-MNIST is not in {raw_dir} (missing {", ".join(missing)}). Install the Debian package '
        f'(apt-get install dataset-fashion-mnist, files in {debian_dir}), or {download_option} to let '
        f'torchvision download it, or put the four IDX files there yourself.')


def _gunzip_atomically(source: str, target: str) -> None:
    with gzip.open(source, 'rb') as src, atomic_open(target, 'wb') as dst:
        shutil.copyfileobj(src, dst)
