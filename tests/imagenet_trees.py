"""Small ImageNet-like folder trees built from real photos (Fashion-MNIST test images written as JPEG).

Fashion-MNIST comes from the Debian package ``dataset-fashion-mnist`` (IDX files in
/usr/share/datasets/fashion-mnist, or the folder named by ``FASHION_MNIST_DIR``). Trees have every one of the 1000
class folders, mostly empty, with the few images a test places in them.
"""
import gzip
import os
import shutil

import numpy as np
from PIL import Image

from lipsformer.evaluation import imagenet_synsets

FASHION_MNIST_DIR = os.environ.get('FASHION_MNIST_DIR', '/usr/share/datasets/fashion-mnist')
_TEST_IMAGES = 't10k-images-idx3-ubyte.gz'


def fashion_mnist_pixels(count: int) -> np.ndarray:
    """The first ``count`` Fashion-MNIST test images, ``(count, 28, 28)`` uint8."""
    path = os.path.join(FASHION_MNIST_DIR, _TEST_IMAGES)
    if not os.path.isfile(path):
        raise FileNotFoundError(
            f'{path} not found: the evaluation tests use real images from Fashion-MNIST. Install them with '
            f'`apt-get install -y dataset-fashion-mnist`, or set FASHION_MNIST_DIR to a folder with {_TEST_IMAGES}')
    with gzip.open(path, 'rb') as f:
        data = f.read()
    header = np.frombuffer(data[:16], dtype='>i4')  # magic, count, rows, cols
    rows, cols = int(header[2]), int(header[3])
    return np.frombuffer(data[16:16 + count * rows * cols], dtype=np.uint8).reshape(count, rows, cols)


def write_jpegs(folder: str, names: list[str]) -> list[str]:
    """Write one Fashion-MNIST image per name (RGB JPEG, 40x40) into ``folder``; returns the paths."""
    os.makedirs(folder, exist_ok=True)
    paths = []
    for pixels, name in zip(fashion_mnist_pixels(len(names)), names):
        path = os.path.join(folder, name)
        Image.fromarray(pixels).convert('RGB').resize((40, 40), Image.BICUBIC).save(path, quality=95)
        paths.append(path)
    return paths


def val_file_name(number: int) -> str:
    """The official ImageNet val file name of image ``number`` (1-based)."""
    return f'ILSVRC2012_val_{number:08d}.JPEG'


def build_tree(root: str, placements: dict[str, int], layout: str = 'synset', subset: bool = False) -> str:
    """Copy images into a class-folder tree with all 1000 class folders (or, with ``subset``, only the folders of
    the classes placed, as an Imagenette-style tree).

    Args:
        root: Folder to create.
        placements: Source image path -> class index it is filed under.
        layout: ``synset`` (ImageNet val, older V2) or ``numeric`` (ImageNet-V2 folders 0..999).
        subset: Create only the folders that receive images.
    """
    synsets = imagenet_synsets()
    folder_names = synsets if layout == 'synset' else [str(i) for i in range(len(synsets))]
    for index, name in enumerate(folder_names):
        if not subset or index in placements.values():
            os.makedirs(os.path.join(root, name), exist_ok=True)
    for source, class_index in placements.items():
        shutil.copyfile(source, os.path.join(root, folder_names[class_index], os.path.basename(source)))
    return root
