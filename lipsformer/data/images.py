"""The one image reader of training, evaluation and the stability sweep: any file Pillow opens, as 8-bit ``L`` or
``RGB``.

Pillow's own conversion clips a 16-bit grey image (``I;16``, common from microscopes, medical and scientific cameras)
to 0..255, leaving it nearly black and white; here its values are scaled to the 8-bit range instead (v * 255 / 65535,
rounded), which keeps a 16-bit copy of an 8-bit image (each value times 257) equal to it. Pillow reads 16-bit RGB
and grey-with-alpha PNGs as their 8-bit modes itself (the high byte). Images whose range cannot be known from their
mode (32-bit integers, floats) are refused with the file named, never guessed.

:data:`IMAGE_EXTENSIONS` are the files an image folder is read from, in training and evaluation alike: timm's and
torchvision's ImageFolder's types together (TIFF among them), so that no image the reader decodes is left out.
"""
import io
import os

import numpy as np
from PIL import Image
from timm.data.readers.img_extensions import get_img_extensions
from torchvision.datasets.folder import IMG_EXTENSIONS as TORCHVISION_IMG_EXTENSIONS

__all__ = ['IMAGE_EXTENSIONS', 'ImageMode', 'UnreadableImageError', 'is_image_file', 'read_image']

# The file types of an image folder (lower case, with the dot): .jpeg .jpg .png .bmp .pgm .ppm .tif .tiff .webp.
IMAGE_EXTENSIONS = frozenset(get_img_extensions(as_set=True) | set(TORCHVISION_IMG_EXTENSIONS))

# Pillow's modes of 16-bit unsigned grey pixels (byte orders).
_SIXTEEN_BIT_MODES = ('I;16', 'I;16L', 'I;16B', 'I;16N')
_SIXTEEN_BIT_MAX = 65535


class UnreadableImageError(ValueError):
    """An image whose pixels cannot be turned into the model's input faithfully; the message names the file."""


def is_image_file(name: str) -> bool:
    """Whether a file of this name is read as an image (its extension, in any case, is one of
    :data:`IMAGE_EXTENSIONS`)."""
    return os.path.splitext(name)[1].lower() in IMAGE_EXTENSIONS


def _name(image: Image.Image) -> str:
    return repr(image.filename) if getattr(image, 'filename', '') else 'an image'


def read_image(image: Image.Image | bytes | str | os.PathLike, mode: str) -> Image.Image:
    """``image`` (a PIL image, a file's bytes or its path) as an 8-bit image of ``mode`` (``'L'`` or ``'RGB'``).

    Raises:
        UnreadableImageError: Its pixels have a range its mode does not tell (32-bit integer or float images).
        OSError: The file is not an image Pillow can decode.
    """
    if isinstance(image, (bytes, bytearray)):
        image = Image.open(io.BytesIO(image))
    elif not isinstance(image, Image.Image):
        with Image.open(image) as opened:
            opened.load()
            return read_image(opened, mode)
    # 'I' is how Pillow before 10.4 opened 16-bit grey PNGs; a PNG holds at most 16 bits per sample.
    if image.mode in _SIXTEEN_BIT_MODES or (image.mode == 'I' and image.format == 'PNG'):
        pixels = np.asarray(image, dtype=np.float64) * (255 / _SIXTEEN_BIT_MAX)
        image = Image.fromarray(np.clip(np.rint(pixels), 0, 255).astype(np.uint8), mode='L')
    elif image.mode in ('I', 'F') or image.mode.startswith('I;'):
        kind = 'floating-point' if image.mode == 'F' else '32-bit integer' if image.mode == 'I' else 'signed integer'
        raise UnreadableImageError(
            f'{_name(image)} holds {kind} pixels (Pillow mode {image.mode!r}), whose range the file does not say, so '
            f'they cannot be scaled to the model\'s input faithfully; save it as an 8- or 16-bit PNG')
    return image if image.mode == mode else image.convert(mode)


class ImageMode:
    """A transform: :func:`read_image` into a colour mode (``'L'`` or ``'RGB'``), for any dataset's images (torchvision
    hands out Fashion-MNIST as ``'L'``; timm's readers hand out a file's bytes here)."""

    def __init__(self, mode: str):
        self.mode = mode

    def __call__(self, image: Image.Image | bytes) -> Image.Image:
        return read_image(image, self.mode)

    def __repr__(self) -> str:
        return f'{type(self).__name__}({self.mode!r})'
