"""The package's C kernels: compiled on first use with the machine's C compiler, cached, loaded through ctypes.

PyTorch exposes no fast CPU kernel for a few of LipsFormer's operations (the depthwise weight gradient, see
``lipsformer.fastpath.depthwise_conv``; the GELU residual's backward, ``lipsformer.fastpath.lean_autograd``); their C
source ships in the package (:data:`CPU_KERNELS`). :func:`load_native` compiles one for the
machine it runs on (``-O3 -march=native``, no PyTorch headers: well under a second) into a shared library cached under
``$LIPSFORMER_CACHE_DIR`` (default ``$XDG_CACHE_HOME/lipsformer`` or ``~/.cache/lipsformer``), in a file named by a
hash of the source, the compiler and the CPU, so that a home folder shared between machines never serves one CPU's
build to another. The library is written under a temporary name and renamed into place (``utils.io``): a kill at any
instant, or two processes compiling at once, leave a whole library or none.

The kernels run their threads on PyTorch's own OpenMP team where they find its runtime, so that they do not contend
for the cores with PyTorch's threads. Where a kernel cannot be built (no compiler, a failing one) a warning says so,
once per source, and the callers keep their PyTorch path, which gives the same values more slowly;
``LIPSFORMER_NATIVE=0`` picks that path without the warning. ``$CC`` picks the compiler (default ``cc``).
"""
import ctypes
import functools
import hashlib
import os
import platform
import re
import shutil
import subprocess
import warnings
from pathlib import Path

import torch

from .env import cpu_name, cpuinfo
from .io import atomic_path

__all__ = ['CPU_KERNELS', 'call_kernel', 'cpu_kernels', 'load_native', 'native_cache_dir', 'native_kernels']

_PACKAGE = Path(__file__).resolve().parent.parent
CPU_KERNELS = 'fastpath/cpu_kernels.c'  # the fast paths' kernels, as load_native takes it
_FLAGS = ('-O3', '-shared', '-fPIC', '-pthread', '-fno-strict-aliasing')
_ARCH_FLAGS = (('-march=native',), ())  # the second where the compiler does not know -march=native


def native_cache_dir() -> Path:
    """Where compiled kernels are kept."""
    if os.environ.get('LIPSFORMER_CACHE_DIR'):
        return Path(os.environ['LIPSFORMER_CACHE_DIR'])
    return Path(os.environ.get('XDG_CACHE_HOME') or Path.home() / '.cache') / 'lipsformer'


def _cpu_identity() -> str:
    """The CPU's name and instruction-set flags: what a -march=native build depends on."""
    info = cpuinfo()
    return f"{platform.machine()} {cpu_name()} {info.get('flags') or info.get('Features', '')}"


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, '--version'], capture_output=True, text=True, timeout=60)
    return result.stdout.splitlines()[0] if result.returncode == 0 and result.stdout else ''


class _CompileError(Exception):
    """A failed compiler run (raised inside atomic_path, so that the partial output is discarded)."""


def _compile(source: Path, compiler: str, version: str) -> tuple[Path | None, str]:
    """The cached library for ``source`` (compiled if missing), or None and the compiler's complaint."""
    complaint = ''
    for arch in _ARCH_FLAGS:
        flags = _FLAGS + arch
        key = hashlib.sha256('\0'.join([source.read_text(), version, ' '.join(flags), _cpu_identity()]).encode())
        library = native_cache_dir() / f'{source.stem}-{key.hexdigest()[:16]}.so'
        if library.is_file():
            return library, ''
        library.parent.mkdir(parents=True, exist_ok=True)
        try:
            with atomic_path(library) as temporary:
                result = subprocess.run([compiler, *flags, str(source), '-o', temporary], capture_output=True,
                                        text=True, timeout=300)
                if result.returncode != 0:
                    raise _CompileError(result.stderr.strip()[-2000:])
        except _CompileError as error:
            complaint = str(error)
            continue
        return library, ''
    return None, complaint


def _load(library: Path) -> ctypes.CDLL:
    try:
        loaded = ctypes.CDLL(str(library))
    except OSError:
        library.unlink(missing_ok=True)  # a library that does not load (a damaged cache) is built again next time
        raise
    if hasattr(loaded, 'use_openmp'):
        _hand_over_openmp(loaded)
    return loaded


def _torch_openmp() -> ctypes.CDLL | None:
    """The OpenMP runtime PyTorch's CPU ops run their threads on, found among the process's mapped libraries (Linux)."""
    try:
        maps = Path('/proc/self/maps').read_text()
    except OSError:
        return None
    paths = {fields[-1] for fields in map(str.split, maps.splitlines()) if len(fields) >= 6}
    runtimes = sorted(path for path in paths if re.search(r'/lib[gi]?omp[^/]*\.so', path))  # GNU, Intel, LLVM
    bundled = [path for path in runtimes if path.startswith(os.path.dirname(torch.__file__))]
    candidates = bundled or runtimes
    return ctypes.CDLL(candidates[0]) if len(candidates) == 1 else None


def _hand_over_openmp(library: ctypes.CDLL) -> None:
    """Let ``library`` run its threads on PyTorch's OpenMP team (see ``cpu_kernels.c``); it keeps POSIX threads where
    PyTorch's runtime cannot be found."""
    if 'ATen parallel backend: OpenMP' not in torch.__config__.parallel_info():
        return
    runtime = _torch_openmp()
    names = ('GOMP_parallel', 'omp_get_thread_num', 'omp_get_num_threads')  # exported by all three runtimes
    if runtime is not None and all(hasattr(runtime, name) for name in names):
        library.use_openmp(*(ctypes.cast(getattr(runtime, name), ctypes.c_void_p) for name in names))


@functools.cache
def load_native(source_name: str) -> ctypes.CDLL | None:
    """The compiled kernel ``lipsformer/<source_name>`` (a C file), or None where it cannot be built.

    Args:
        source_name: Path of the C source inside the package, e.g. :data:`CPU_KERNELS`.
    """
    if os.environ.get('LIPSFORMER_NATIVE', '1') == '0':
        return None
    compiler = os.environ.get('CC') or 'cc'
    source = _PACKAGE / source_name
    try:
        if shutil.which(compiler) is None:
            raise FileNotFoundError(f'{compiler}: no such command')
        compiler = shutil.which(compiler)
        library, complaint = _compile(source, compiler, _compiler_version(compiler))
        if library is not None:
            return _load(library)
    except (OSError, subprocess.SubprocessError) as error:
        complaint = str(error)
    warnings.warn(f'lipsformer: could not build or load its C kernel {source_name} with {compiler} ({complaint}); '
                  'using the slower PyTorch path, which gives the same values. Set CC to a working C compiler, or '
                  'LIPSFORMER_NATIVE=0 to use the PyTorch path without this warning.', RuntimeWarning, stacklevel=2)
    return None


def native_kernels() -> dict[str, bool]:
    """The package's C kernels (:data:`CPU_KERNELS`) and whether they are built and loaded here (built if needed)."""
    return {CPU_KERNELS: load_native(CPU_KERNELS) is not None}


def call_kernel(library: ctypes.CDLL, name: str, tensors: tuple[torch.Tensor, ...], sizes: tuple[int, ...]) -> None:
    """``library.name(*data pointers of tensors, *sizes as int64)``. The kernels return 0, or 1 for arguments they
    do not take (the callers check shapes first, so that is a bug)."""
    status = getattr(library, name)(*(ctypes.c_void_p(t.data_ptr()) for t in tensors),
                                    *(ctypes.c_int64(n) for n in sizes))
    if status != 0:
        raise RuntimeError(f'{name} rejected tensors of shapes {[tuple(t.shape) for t in tensors]}, sizes {sizes}')


def cpu_kernels(*tensors: torch.Tensor) -> ctypes.CDLL | None:
    """The layers' kernels (:data:`CPU_KERNELS`) where they may stand in for PyTorch ops on ``tensors`` in a backward:
    all float32 on CPU, the backward not recorded by autograd (a double backward) nor traced by dynamo (the C calls are
    invisible to both); else None, as where they cannot be built."""
    if (all(t.device.type == 'cpu' and t.dtype == torch.float32 for t in tensors) and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()):
        return load_native(CPU_KERNELS)
    return None
