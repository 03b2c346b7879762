"""Tiny real-image datasets for the training and data tests: an image-folder tree and the same images as WebDataset
shards.

Images come from Fashion-MNIST (the Debian package's IDX files, read by :func:`lipsformer.data.read_fashion_mnist`)
when it is installed; otherwise from class-dependent synthetic patterns, so the tests never skip for lack of data.
"""
import io
import json
import os
import tarfile

import numpy as np
from PIL import Image

from lipsformer.data import DEBIAN_FASHION_MNIST, read_fashion_mnist


def grayscale_images(num_classes: int, per_class: int, split: str, seed: int = 0) -> list[tuple[np.ndarray, int]]:
    """``per_class`` 28x28 uint8 images for each of the first ``num_classes`` classes."""
    if os.path.isdir(DEBIAN_FASHION_MNIST):
        images, labels = (t.numpy() for t in read_fashion_mnist('train' if split == 'train' else 'test'))
        chosen = []
        for label in range(num_classes):
            chosen += [(images[i], label) for i in np.flatnonzero(labels == label)[:per_class]]
        return chosen
    rng = np.random.default_rng(seed + (split == 'train'))
    chosen = []
    for label in range(num_classes):
        for _ in range(per_class):
            image = rng.integers(0, 60, (28, 28))
            image[:, 3 * label:3 * label + 6] += 180  # a class-specific vertical bar
            chosen.append((image.astype(np.uint8), label))
    return chosen


def make_image_folder(root: str, num_classes: int = 4, train_per_class: int = 12, val_per_class: int = 6) -> str:
    """An ImageFolder tree ``root/{train,validation}/class_<k>/<i>.png``; returns ``root``."""
    for split, per_class in (('train', train_per_class), ('validation', val_per_class)):
        for index, (pixels, label) in enumerate(grayscale_images(num_classes, per_class, split)):
            folder = os.path.join(root, split, f'class_{label}')
            os.makedirs(folder, exist_ok=True)
            Image.fromarray(pixels, mode='L').save(os.path.join(folder, f'{index:05d}.png'))
    return root


def make_webdataset(root: str, num_classes: int = 4, train_per_class: int = 12, val_per_class: int = 6) -> str:
    """The same images as :func:`make_image_folder` as WebDataset shards (``<key>.png`` + ``<key>.cls``) with the
    ``_info.json`` timm's ``wds/`` reader reads: two training shards, one validation shard."""
    os.makedirs(root, exist_ok=True)
    info: dict = {'name': 'tiny', 'splits': {}}
    for split, per_class, shards in (('train', train_per_class, 2), ('validation', val_per_class, 1)):
        samples = grayscale_images(num_classes, per_class, split)
        names, lengths = [], []
        for shard in range(shards):
            name = f'{split}-{shard:06d}.tar'
            part = samples[shard::shards]
            with tarfile.open(os.path.join(root, name), 'w') as tar:
                for index, (pixels, label) in enumerate(part):
                    png = io.BytesIO()
                    Image.fromarray(pixels, mode='L').save(png, format='PNG')
                    for suffix, data in (('png', png.getvalue()), ('cls', str(label).encode())):
                        member = tarfile.TarInfo(f'{split}_{shard}_{index:05d}.{suffix}')
                        member.size = len(data)
                        tar.addfile(member, io.BytesIO(data))
            names.append(name)
            lengths.append(len(part))
        info['splits'][split] = dict(name=split, num_samples=sum(lengths), filenames=names, shard_lengths=lengths)
    with open(os.path.join(root, '_info.json'), 'w') as f:
        json.dump(info, f)
    return root
