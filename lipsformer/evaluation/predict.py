"""Top-k predictions for a list of image files, on one process or sharded across processes with Accelerate.

Every sample carries its index through the loader, and the gathered predictions are placed by that index, so the
result is in data set order whatever the sharding, and the duplicates Accelerate pads the last batches with only
overwrite an entry with the same values. Unreadable images are not fatal: they are marked and left out of scoring.
"""
import logging
import time
from dataclasses import dataclass

import torch
from accelerate import Accelerator
from PIL import Image
from timm.data import create_transform
from torch.utils.data import DataLoader, Dataset

from ..data import read_image
from .errors import EvaluationError

__all__ = ['EvalImageDataset', 'InferenceSettings', 'Predictions', 'predict']

_logger = logging.getLogger(__name__)

# What PIL raises for a file that is not a decodable image (UnidentifiedImageError and truncation are OSErrors).
_UNREADABLE_IMAGE_ERRORS = (OSError, ValueError, SyntaxError, Image.DecompressionBombError)


@dataclass(frozen=True)
class InferenceSettings:
    """How images are fed to the model on each process.

    Attributes:
        batch_size: Images per batch.
        workers: DataLoader worker processes.
        channels_last: Feed NHWC tensors (the model should be channels-last too).
        log_every: Log progress every this many batches (main process); 0: never.
    """
    batch_size: int = 256
    workers: int = 4
    channels_last: bool = False
    log_every: int = 50


class EvalImageDataset(Dataset):
    """Image files (or the images of a dataset) transformed for evaluation; yields ``(image, index, readable,
    target)``, the target -1 for image files (their labels are known beforehand).

    A file PIL cannot decode gives a zero image with ``readable`` False and a logged warning, so one bad file in
    50,000 neither stops the run nor shifts the labels of the others. A ``source`` dataset yields ``(PIL image,
    target)`` and marks an unreadable image with the target -1 (as ``lipsformer.data.RobustDataset`` does).
    """

    def __init__(self, paths: list[str], data_config: dict, source: Dataset | None = None):
        self.paths = paths
        self.source = source
        self.input_size = tuple(data_config['input_size'])
        self.mode = 'RGB' if self.input_size[0] == 3 else 'L'
        self.transform = create_transform(**data_config, is_training=False)

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int, bool, int]:
        if self.source is not None:
            image, target = self.source[index]
            return self.transform(read_image(image, self.mode)), index, target >= 0, target
        try:
            return self.transform(read_image(self.paths[index], self.mode)), index, True, -1
        except _UNREADABLE_IMAGE_ERRORS as e:
            _logger.warning('skipping unreadable image %s: %s', self.paths[index], e)
            return torch.zeros(self.input_size), index, False, -1


@dataclass(frozen=True)
class Predictions:
    """Per-image results in data set order.

    Attributes:
        topk: ``(N, k)`` predicted class indices, best first (k = min(5, number of classes)).
        readable: ``(N,)`` bool, False where the image could not be decoded.
        seconds: Wall time of the pass (after a warm-up batch), for images/s.
        targets: ``(N,)`` the labels a ``source`` dataset gave (-1 for image files).
    """
    topk: torch.Tensor
    readable: torch.Tensor
    seconds: float
    targets: torch.Tensor


def predict(
        model: torch.nn.Module,
        paths: list[str],
        data_config: dict,
        accelerator: Accelerator,
        settings: InferenceSettings = InferenceSettings(),
        name: str = '',
        source: Dataset | None = None,
) -> Predictions:
    """Run ``model`` (in eval mode, on ``accelerator.device``) over ``paths``.

    Args:
        model: The classifier.
        paths: Image files; their order is the order of the result.
        data_config: timm data config (input_size, interpolation, mean, std, crop_pct, crop_mode).
        accelerator: Decides devices, sharding and mixed precision.
        settings: Batch size, workers, memory format and progress logging.
        name: Data set name for the progress log.
        source: A dataset to read the images (and their labels) from instead of ``paths``.
    """
    dataset = EvalImageDataset(paths, data_config, source)
    loader = accelerator.prepare_data_loader(DataLoader(
        dataset, batch_size=settings.batch_size, shuffle=False, num_workers=settings.workers,
        pin_memory=accelerator.device.type == 'cuda'))
    memory_format = torch.channels_last if settings.channels_last else torch.contiguous_format
    readable = torch.zeros(len(dataset), dtype=torch.bool)
    targets = torch.full((len(dataset),), -1, dtype=torch.long)
    filled = torch.zeros(len(dataset), dtype=torch.bool)
    with torch.inference_mode():
        batch = min(settings.batch_size, len(dataset))
        try:
            warmup = torch.zeros((batch, *dataset.input_size), device=accelerator.device)
            with accelerator.autocast():
                k = min(5, model(warmup.contiguous(memory_format=memory_format)).shape[1])
        except (RuntimeError, MemoryError) as error:
            if not _out_of_memory(error):
                raise
            size = 'x'.join(map(str, dataset.input_size))
            raise EvaluationError(
                f'a batch of {batch} images of {size} does not fit in the memory of {accelerator.device} '
                f'({str(error).strip().splitlines()[0][:200]}); lower the batch size (-b) or the input size '
                f'(--img-size / --input-size)') from error
        topk = torch.full((len(dataset), k), -1, dtype=torch.long)
        start = time.perf_counter()
        for batch_index, (images, indices, ok, labels) in enumerate(loader):
            with accelerator.autocast():
                logits = model(images.contiguous(memory_format=memory_format))
            batch_topk = logits.float().topk(k, dim=1).indices
            indices, batch_topk, ok, labels = accelerator.gather_for_metrics(
                (indices, batch_topk, ok.to(torch.uint8), labels))
            indices = indices.cpu()
            topk[indices] = batch_topk.cpu()
            readable[indices] = ok.cpu().bool()
            targets[indices] = labels.cpu()
            filled[indices] = True
            if accelerator.is_main_process and settings.log_every and (batch_index + 1) % settings.log_every == 0:
                done = int(filled.sum())
                _logger.info('%s: %d/%d images, %.1f images/s', name, done, len(dataset),
                             done / (time.perf_counter() - start))
        seconds = time.perf_counter() - start
    if not filled.all():
        raise RuntimeError(f'{int((~filled).sum())} images got no prediction; the data loader lost samples')
    return Predictions(topk=topk, readable=readable, seconds=seconds, targets=targets)


def _out_of_memory(error: BaseException) -> bool:
    """Whether an allocation failed: CUDA's out-of-memory error, the CPU allocator's refusal or Python's."""
    return (isinstance(error, (MemoryError, torch.cuda.OutOfMemoryError))
            or "can't allocate memory" in str(error) or 'out of memory' in str(error))
