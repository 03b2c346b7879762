"""Keep freed CPU tensor memory in the process, so that training steps stop page-faulting their activations.

PyTorch allocates CPU tensors with the C library's ``malloc``. glibc serves a request above its mmap threshold
(128 KiB at start, raised as large blocks are freed, but never above 32 MiB) with fresh pages from ``mmap`` and
returns them to the kernel on ``free``. A training step whose activations are larger than that gets new pages for
them on every step, and the kernel zero-fills every 4 KiB page on its first touch (lipsformer_swin_tiny's MLP hidden
activations alone are 77 MiB per block at batch 16 and 224). :func:`retain_freed_memory` turns ``mmap`` allocation
off and raises the trim threshold, so freed blocks stay in the heap and the next step reuses them, as PyTorch's CUDA
caching allocator does on a GPU. The price: the process keeps its peak resident memory until it exits
(``malloc_trim`` still hands free pages back on request). docs/performance.md gives the
measured page faults and step times. The same effect from outside the process: ``MALLOC_MMAP_MAX_=0
MALLOC_TRIM_THRESHOLD_=2147483647``, or ``LD_PRELOAD`` of jemalloc or tcmalloc.
"""
import ctypes
import ctypes.util
import platform

__all__ = ['retain_freed_memory']

# mallopt parameter numbers from glibc's <malloc.h>.
_M_TRIM_THRESHOLD = -1
_M_MMAP_MAX = -4
_INT_MAX = 2 ** 31 - 1


def retain_freed_memory() -> bool:
    """Make glibc's malloc keep freed memory for reuse instead of unmapping it; the whole process is affected.

    Returns:
        True if the settings were applied; False where the C library is not glibc (macOS, Windows, musl), whose
        allocators are left as they are.
    """
    if platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc':
        return False
    libc = ctypes.CDLL(ctypes.util.find_library('c'))
    # mallopt returns 1 on success. Both settings also stop glibc's dynamic threshold, which they replace.
    return bool(libc.mallopt(_M_MMAP_MAX, 0)) and bool(libc.mallopt(_M_TRIM_THRESHOLD, _INT_MAX))
