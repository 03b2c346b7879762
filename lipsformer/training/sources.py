"""Getting datasets onto disk: Fashion-MNIST from the Debian package, else torchvision's downloader.

torchvision's ``FashionMNIST(root)`` reads the four uncompressed IDX files from ``<root>/FashionMNIST/raw``. The
Debian package ``dataset-fashion-mnist`` ships the same files gzipped in :data:`DEBIAN_FASHION_MNIST`; when they are
there they are unpacked into the root, so no network is needed.
"""
import gzip
import os
import shutil

from ..utils.io import atomic_open

DEBIAN_FASHION_MNIST = '/usr/share/datasets/fashion-mnist'
FASHION_MNIST_FILES = ('train-images-idx3-ubyte', 'train-labels-idx1-ubyte', 't10k-images-idx3-ubyte',
                       't10k-labels-idx1-ubyte')


class DatasetNotFoundError(FileNotFoundError):
    """The dataset is not on disk and cannot be fetched; the message says how to get it."""


def prepare_dataset(name: str, root: str | None, download: bool, debian_dir: str = DEBIAN_FASHION_MNIST) -> None:
    """Make a torchvision dataset readable offline when a local copy exists.

    Args:
        name: The config's ``data.dataset``; only ``torch/fashion_mnist`` needs preparing.
        root: The dataset root (``data.data_dir``).
        download: Whether torchvision may download what is missing.
        debian_dir: Where the Debian package keeps its gzipped IDX files.

    Raises:
        DatasetNotFoundError: Fashion-MNIST is neither in the root nor in the Debian package and ``download`` is off.
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
    if all(os.path.isfile(p) for p in packaged):
        os.makedirs(raw_dir, exist_ok=True)
        for name_, source in zip(missing, packaged, strict=True):
            _gunzip_atomically(source, os.path.join(raw_dir, name_))
        return
    if download:
        return
    raise DatasetNotFoundError(
        f'Fashion-MNIST is not in {raw_dir} (missing {", ".join(missing)}). Install the Debian package '
        f'(apt-get install dataset-fashion-mnist, files in {debian_dir}), or set data.download=true to let '
        f'torchvision download it, or put the four IDX files there yourself.')


def _gunzip_atomically(source: str, target: str) -> None:
    with gzip.open(source, 'rb') as src, atomic_open(target, 'wb') as dst:
        shutil.copyfileobj(src, dst)
