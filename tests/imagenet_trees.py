"""Small ImageNet-like folder trees built from real photos (Fashion-MNIST test images written as JPEG).

Fashion-MNIST comes from the Debian package ``dataset-fashion-mnist`` (IDX files in
/usr/share/datasets/fashion-mnist, or the folder named by ``FASHION_MNIST_DIR``). Trees have every one of the 1000
class folders, mostly empty, with the few images a test places in them.
"""
import os
import shutil

import numpy as np
from PIL import Image

from lipsformer.data import DEBIAN_FASHION_MNIST, DatasetNotFoundError, read_fashion_mnist
from lipsformer.evaluation import imagenet_synsets

FASHION_MNIST_DIR = os.environ.get('FASHION_MNIST_DIR', DEBIAN_FASHION_MNIST)


def fashion_mnist_pixels(count: int) -> np.ndarray:
    """The first ``count`` Fashion-MNIST test images, ``(count, 28, 28)`` uint8."""
    try:
        images, _ = read_fashion_mnist('test', FASHION_MNIST_DIR)
    except DatasetNotFoundError as e:
        raise FileNotFoundError(f'the evaluation tests use real images from Fashion-MNIST: {e} (or set '
                                f'FASHION_MNIST_DIR)') from e
    return images[:count].numpy()


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
