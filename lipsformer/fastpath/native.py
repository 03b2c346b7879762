"""The package's C kernels: compiled on first use with the machine's C compiler, cached, loaded through ctypes.

PyTorch exposes no fast CPU kernel for a few of LipsFormer's operations (the depthwise weight gradient, see
:mod:`.depthwise_conv`; the GELU residual's backward, :mod:`.lean_autograd`); their C source ships in the package
(:data:`CPU_KERNELS`). :func:`load_native` compiles one for the CPU it runs on (``-O3 -march=native``, no PyTorch
headers, so the build is short) into a shared library cached under ``$LIPSFORMER_CACHE_DIR`` (default
``$XDG_CACHE_HOME/lipsformer`` or ``~/.cache/lipsformer``), in a file named by a hash of the source, the compiler and
the CPU, so that a home folder shared between machines never serves one CPU's build to another. The library is
written under a temporary name and renamed into place (``lipsformer.utils.io``): a kill at any instant, or two
processes compiling at once, leave a whole library or none.

Loading a library runs its code, so only this user's own builds are loaded: the cache folder is created 0700, and a
library is loaded only when the folder and the library belong to the current user, neither can be written by group or
others, and the library's bytes have the SHA-256 recorded beside it (``<library>.sha256``) when it was built; it is
checked through one open file, in a folder no one else can write. A cached library that fails a check is
not loaded but built again; a cache folder that fails one (another user's, writable by others, read-only) is not used:
the kernel is built in a private temporary folder instead. Either way one warning names the check and
``LIPSFORMER_CACHE_DIR``.

The kernels run their threads on PyTorch's own OpenMP team where they find its runtime, so that they do not contend
for the cores with PyTorch's threads. Where a kernel cannot be built (no compiler, a failing one) a warning says so,
once per source, and the callers keep their PyTorch path, which gives the same values more slowly;
``LIPSFORMER_NATIVE=0`` picks that path without the warning, for the whole process; :class:`set_native_kernels`
picks it for a block of code (the benchmark's ``native=False`` model spec). ``$CC`` picks the compiler (default
``cc``).
"""
import ctypes
import functools
import hashlib
import os
import platform
import pwd
import re
import shutil
import stat
import subprocess
import tempfile
import warnings
from pathlib import Path

import torch

from ..utils.env import cpu_name, cpuinfo
from ..utils.io import atomic_path, write_text

__all__ = ['CPU_KERNELS', 'call_kernel', 'cpu_kernels', 'load_native', 'native_cache_dir', 'native_kernels',
           'set_native_kernels']

_PACKAGE = Path(__file__).resolve().parent.parent
CPU_KERNELS = 'fastpath/cpu_kernels.c'  # the fast paths' kernels, as load_native takes it
_FLAGS = ('-O3', '-shared', '-fPIC', '-pthread', '-fno-strict-aliasing')
_ARCH_FLAGS = (('-march=native',), ())  # the second where the compiler does not know -march=native
_DIGEST_SUFFIX = '.sha256'
_TRUST_HINT = ('Set LIPSFORMER_CACHE_DIR to a folder of your own that you can write and no one else can '
               '(or LIPSFORMER_NATIVE=0 for the PyTorch path).')


_enabled = True  # set_native_kernels: whether cpu_kernels hands out the C kernels


class set_native_kernels:  # noqa: N801 (a function that is also a context manager, as fastpath's set_fast_path)
    """Let the fast paths call the C kernels (``True`` or ``None``, the default: where they can be built) or not
    (``False``: their PyTorch path, the same values more slowly): ``set_native_kernels(False)`` for the rest of the
    process, or ``with set_native_kernels(False): ...`` for a block, after which the previous state returns.

    Unlike ``LIPSFORMER_NATIVE=0``, read once per process by :func:`load_native`, it can change between two calls, so
    that one process times a model with its kernels and without them; ``True`` cannot override that variable.
    """

    def __init__(self, enable: bool | None = True) -> None:
        global _enabled
        self.previous = _enabled
        _enabled = enable is None or bool(enable)

    def __enter__(self) -> 'set_native_kernels':
        return self

    def __exit__(self, *exc_info: object) -> None:
        global _enabled
        _enabled = self.previous


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


class _Refused(Exception):
    """A cache folder or library that fails a check; the message names the check."""


def _library_path(folder: Path, source: Path, version: str, flags: tuple[str, ...]) -> Path:
    """The library built from ``source`` with this compiler and these flags for this CPU, in ``folder``."""
    key = hashlib.sha256('\0'.join([source.read_text(), version, ' '.join(flags), _cpu_identity()]).encode())
    return folder / f'{source.stem}-{key.hexdigest()[:16]}.so'


def _user(uid: int) -> str:
    try:
        return f'{pwd.getpwuid(uid).pw_name} (uid {uid})'
    except KeyError:
        return f'uid {uid}'


def ownership_problem(status: os.stat_result, what: str) -> str:
    """Why a file or folder's :func:`os.stat` makes it unfit to hold code this process loads ('' when fit): it must
    belong to the current user and be writable by no group and no other user."""
    uid = os.geteuid()
    if status.st_uid != uid:
        return f'{what} belongs to {_user(status.st_uid)}, not to this user, {_user(uid)}'
    writers = [who for who, bit in (('its group', stat.S_IWGRP), ('other users', stat.S_IWOTH)) if status.st_mode & bit]
    if writers:
        return f'{what} can be written by {" and ".join(writers)} (mode {stat.S_IMODE(status.st_mode):o})'
    return ''


def _private_folder(folder: Path) -> None:
    """Create ``folder`` and any missing parent with mode 0700 (whatever the umask); check the folder is fit.

    Raises:
        _Refused: It cannot be created, or it belongs to another user or can be written by others.
    """
    missing = []
    current = folder
    while not os.path.lexists(current) and current != current.parent:
        missing.append(current)
        current = current.parent
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # made meanwhile by another process
        except OSError as error:
            raise _Refused(f'the kernel cache folder {folder} cannot be created ({error.strerror})') from error
    try:
        problem = ownership_problem(os.stat(folder), f'the kernel cache folder {folder}')
    except OSError as error:
        raise _Refused(f'the kernel cache folder {folder} cannot be read ({error.strerror})') from error
    if problem:
        raise _Refused(f'{problem}, so nothing in it is loaded')


def _digest(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, 1 << 20, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


def _recorded_digest(library: Path) -> str | None:
    try:
        return library.with_name(library.name + _DIGEST_SUFFIX).read_text().strip()
    except OSError:
        return None


def _load_checked(library: Path, expected: str | None = None) -> ctypes.CDLL | None:
    """Load ``library`` if it passes the checks (made on the file opened, not on its name); None when it has no recorded
    hash (a build of an earlier version: built again without a word).

    Raises:
        _Refused: It is not a plain file of this user's that only this user can write, or its bytes are not the ones
            recorded when it was built.
        OSError: It passes the checks but does not load (a damaged build: removed, so that it is built again).
    """
    try:
        fd = os.open(library, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise _Refused(f'the cached library {library} cannot be opened as a plain file ({error.strerror})') from error
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise _Refused(f'the cached library {library} is not a plain file')
        problem = ownership_problem(status, f'the cached library {library}')
        if problem:
            raise _Refused(problem)
        expected = expected or _recorded_digest(library)
        if expected is None:
            return None
        if _digest(fd) != expected:
            raise _Refused(f'the cached library {library} does not have the SHA-256 recorded when it was built')
        try:  # the file checked: only this user can write the folder, so no one else can swap it meanwhile
            loaded = ctypes.CDLL(str(library))
        except OSError:
            library.unlink(missing_ok=True)  # a library that does not load (a damaged cache) is built again next time
            raise
    finally:
        os.close(fd)
    if hasattr(loaded, 'use_openmp'):
        _hand_over_openmp(loaded)
    return loaded


def _build(source: Path, compiler: str, version: str, folder: Path) -> tuple[ctypes.CDLL | None, str, str]:
    """The kernel from ``folder`` (a checked cache or a private folder), built there if needed.

    Returns:
        The loaded library or None; the compiler's complaint when it is None; and the check a cached library failed
        ('' when none did), which was then built again.

    Raises:
        _Refused: ``folder`` cannot be written.
    """
    complaint, refused = '', ''
    for arch in _ARCH_FLAGS:
        flags = _FLAGS + arch
        library = _library_path(folder, source, version, flags)
        if os.path.lexists(library):
            try:
                loaded = _load_checked(library)
            except _Refused as error:
                refused, loaded = str(error), None
            if loaded is not None:
                return loaded, '', refused
        try:
            with atomic_path(library) as temporary:
                try:
                    open(temporary, 'wb').close()  # the compiler's output file: can this folder be written?
                except OSError as error:
                    raise _Refused(f'the kernel cache folder {folder} cannot be written ({error.strerror})') from error
                result = subprocess.run([compiler, *flags, str(source), '-o', temporary], capture_output=True,
                                        text=True, timeout=300)
                if result.returncode != 0:
                    raise _CompileError(result.stderr.strip()[-2000:] or f'{compiler} exited with status '
                                                                         f'{result.returncode} and printed nothing')
                os.chmod(temporary, 0o755)  # the linker's mode follows the umask: writable by no one else
                with open(temporary, 'rb') as f:
                    digest = _digest(f.fileno())
                loaded = _load_checked(Path(temporary), digest)  # what this process built, whoever renames last
        except _CompileError as error:
            complaint = str(error)
            continue
        record = library.with_name(library.name + _DIGEST_SUFFIX)
        write_text(record, digest)
        os.chmod(record, 0o644)  # like the library, whatever the umask
        return loaded, '', refused
    return None, complaint, refused


def _load_or_build(source: Path, compiler: str, version: str) -> tuple[ctypes.CDLL | None, str, str, bool]:
    """The kernel, from the cache when it can be trusted, else built in a private temporary folder.

    Returns:
        The loaded library or None; the compiler's complaint when None; the check that failed ('' if none); and
        whether the kernel was built in a private folder because the cache folder failed it.
    """
    folder = native_cache_dir()
    try:
        _private_folder(folder)
        return (*_build(source, compiler, version, folder), False)
    except _Refused as error:
        problem = str(error)
    private = Path(tempfile.mkdtemp(prefix='lipsformer-kernels-'))  # 0700, this user's
    try:
        loaded, complaint, _ = _build(source, compiler, version, private)
    finally:
        shutil.rmtree(private, ignore_errors=True)  # a loaded library stays mapped
    return loaded, complaint, problem, True


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
    problem = ''
    try:
        if shutil.which(compiler) is None:
            raise FileNotFoundError(f'{compiler}: no such command')
        compiler = shutil.which(compiler)
        library, complaint, problem, private = _load_or_build(source, compiler, _compiler_version(compiler))
    except (OSError, subprocess.SubprocessError) as error:
        library, complaint = None, str(error) or type(error).__name__
    if library is not None:
        if problem:
            where = 'in a private temporary folder (again in every process)' if private else 'again, in its place'
            warnings.warn(f'lipsformer: {problem}; its C kernel {source_name} was built {where}. {_TRUST_HINT}',
                          RuntimeWarning, stacklevel=2)
        return library
    also = f' ({problem})' if problem else ''
    warnings.warn(f'lipsformer: could not build or load its C kernel {source_name} with {compiler} ({complaint})'
                  f'{also}; using the slower PyTorch path, which gives the same values. Set CC to a working C '
                  'compiler, or LIPSFORMER_NATIVE=0 to use the PyTorch path without this warning.', RuntimeWarning,
                  stacklevel=2)
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
    invisible to both), and not switched off (:class:`set_native_kernels`); else None, as where they cannot be built.
    This is the one place the callers get a kernel from."""
    if (_enabled and all(t.device.type == 'cpu' and t.dtype == torch.float32 for t in tensors)
            and not torch.is_grad_enabled() and not torch.compiler.is_compiling()):
        return load_native(CPU_KERNELS)
    return None
