"""Where the package's Triton kernels run: a GPU, or the CPU under Triton's interpreter (``TRITON_INTERPRET=1``, set
before Triton is imported), for float32, bfloat16 and float16 tensors."""
import os

import torch

__all__ = ['TRITON_DTYPES', 'triton_device']

TRITON_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def triton_device(x: torch.Tensor) -> bool:
    """Whether a Triton kernel may take ``x``: its dtype one of :data:`TRITON_DTYPES`, on a CUDA device or on the CPU
    under Triton's interpreter (whether Triton is installed is each kernel module's own check)."""
    if x.dtype not in TRITON_DTYPES:
        return False
    return x.device.type == 'cuda' or x.device.type == 'cpu' and os.environ.get('TRITON_INTERPRET') == '1'
