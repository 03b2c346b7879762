"""The C kernels (lipsformer.fastpath.native) and the one they serve: the 7x7 depthwise weight gradient."""
import hashlib
import os
import platform
import re
import shutil
import stat
import subprocess
import warnings

import pytest
import torch
import torch.nn.functional as F

from lipsformer.fastpath import depthwise_conv, native

SOURCE = native.CPU_KERNELS


@pytest.fixture(autouse=True)
def _fresh_loader():
    native.load_native.cache_clear()
    yield
    native.load_native.cache_clear()


def _reference(x: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """dL/dW of F.conv2d by autograd, in float64: the definition, not another fast path."""
    weight = torch.zeros(x.shape[-1], 1, 7, 7, dtype=torch.float64, requires_grad=True)
    with torch.enable_grad():
        out = F.conv2d(x.double().permute(0, 3, 1, 2), weight, padding=3, groups=x.shape[-1])
        return torch.autograd.grad(out, weight, grad.double().permute(0, 3, 1, 2))[0]


def _assert_close_to_reference(got: torch.Tensor, x: torch.Tensor, grad: torch.Tensor) -> None:
    # float32 sums of up to 1000 products, in another order: close relative to the largest entry
    reference = _reference(x, grad)
    torch.testing.assert_close(got.double(), reference, rtol=1e-5, atol=1e-5 * reference.abs().max().item())


def _kernel() -> object:
    library = native.load_native(SOURCE)
    assert library is not None, 'a C compiler is installed (CI has one): the kernel must build'
    return library


# Maps narrower than the 7-column window (1-3 columns), a single row, odd sizes, one image, 16-64 channels.
@pytest.mark.parametrize('shape', [(2, 5, 1, 16), (1, 1, 2, 32), (3, 4, 3, 16), (2, 9, 13, 48), (4, 14, 14, 64),
                                   (1, 8, 30, 16)])
@pytest.mark.parametrize('threads', [1, 3])
def test_the_kernel_gives_the_weight_gradient_of_the_convolution(shape, threads):
    library = _kernel()
    x, grad = torch.randn(shape), torch.randn(shape)
    with_threads = torch.get_num_threads()
    torch.set_num_threads(threads)  # more threads than (image, channel block) items in some shapes
    try:
        got = depthwise_conv._native_weight_grad(library, x, grad)
    finally:
        torch.set_num_threads(with_threads)
    _assert_close_to_reference(got, x, grad)


def test_the_depthwise_conv_takes_the_kernel_and_matches_the_per_image_path(monkeypatch):
    _kernel()
    x = torch.randn(3, 10, 12, 32)
    grad = torch.randn(3, 10, 12, 32).transpose(1, 2).contiguous().transpose(1, 2)  # a non-contiguous gradient
    calls = []
    monkeypatch.setattr(depthwise_conv, '_native_weight_grad',
                        lambda *args, real=depthwise_conv._native_weight_grad: calls.append(1) or real(*args))
    with torch.no_grad():  # as in a backward
        fast = depthwise_conv._weight_grad(x, grad, (3, 3), (7, 7))
        monkeypatch.setenv('LIPSFORMER_NATIVE', '0')
        native.load_native.cache_clear()
        per_image = depthwise_conv._weight_grad(x, grad, (3, 3), (7, 7))
    assert calls == [1] and native.load_native(SOURCE) is None
    torch.testing.assert_close(fast, per_image, rtol=1e-5, atol=1e-5 * per_image.abs().max().item())
    _assert_close_to_reference(fast, x, grad)


def test_channels_off_the_vector_width_and_other_kernels_take_the_per_image_path(monkeypatch):
    block = _kernel().channel_block()
    assert block in (8, 16)
    monkeypatch.setattr(depthwise_conv, '_native_weight_grad', lambda *args: pytest.fail('not for these shapes'))
    x, grad = torch.randn(2, 6, 6, block + 4), torch.randn(2, 6, 6, block + 4)
    with torch.no_grad():
        _assert_close_to_reference(depthwise_conv._weight_grad(x, grad, (3, 3), (7, 7)), x, grad)
        x, grad = torch.randn(2, 6, 6, 16), torch.randn(2, 6, 6, 16)
        assert depthwise_conv._weight_grad(x, grad, (1, 1), (3, 3)).shape == (16, 1, 3, 3)


# What CPUs without AVX-512 get (8 channels a vector): on x86 the SSE2 baseline and AVX2; elsewhere the default.
_PORTABLE_ARCHS = ([('-march=x86-64',), ('-march=x86-64-v3',)] if platform.machine() in ('x86_64', 'AMD64')
                   else [()])


@pytest.mark.parametrize('arch', _PORTABLE_ARCHS, ids=lambda arch: ' '.join(arch) or 'default')
def test_the_eight_channel_build_gives_the_float64_gradients(arch, tmp_path, monkeypatch):
    from lipsformer.fastpath import lean_autograd
    probe = subprocess.run([os.environ.get('CC') or 'cc', *arch, '-x', 'c', '-c', '-o', os.devnull, '-'],
                           input='int x;', capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip(f'the compiler does not take {arch}: {probe.stderr.strip()[-200:]}')
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(tmp_path))
    monkeypatch.setattr(native, '_ARCH_FLAGS', (arch,))
    library = _kernel()
    assert library.channel_block() == 8
    x, grad = torch.randn(3, 9, 13, 24), torch.randn(3, 9, 13, 24)  # 24 channels: three 8-wide blocks
    z, scale = 4 * torch.randn(3, 9, 13, 24), torch.rand(3, 1, 1, 24)
    with torch.no_grad():  # as in a backward
        _assert_close_to_reference(depthwise_conv._native_weight_grad(library, x, grad), x, grad)
        got = lean_autograd._native_gelu_residual_backward(grad, z, scale)
    assert got is not None  # the kernel took them
    z64, scale64 = z.double().requires_grad_(True), scale.double().requires_grad_(True)
    expected = torch.autograd.grad(F.gelu(z64) * scale64, (z64, scale64), grad.double())
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.double(), e, rtol=1e-5, atol=2e-6 * e.abs().max().item())


def _fake_compiler(folder, script: str) -> str:
    """An executable that answers --version and otherwise runs ``script`` (sh), logging each build."""
    path = os.path.join(folder, 'fakecc')
    with open(path, 'w') as f:
        f.write(f'#!/bin/sh\nif [ "$1" = --version ]; then echo fakecc 1.0; exit 0; fi\n'
                f'echo build >> {folder}/builds\n{script}\n')
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)
    return path


def test_a_failing_compiler_warns_with_its_message_and_leaves_no_file(tmp_path, monkeypatch):
    cache = tmp_path / 'cache'
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(cache))
    monkeypatch.setenv('CC', _fake_compiler(tmp_path, 'echo "fatal: no space left" >&2; exit 1'))
    with pytest.warns(RuntimeWarning, match=r'could not build or load its C kernel fastpath/cpu_kernels.c .*'
                                            r'fatal: no space left.*same values.*LIPSFORMER_NATIVE=0'):
        assert native.load_native(SOURCE) is None
    assert (tmp_path / 'builds').read_text().count('build') == 2  # with -march=native, then without
    assert list(cache.iterdir()) == []  # the partial outputs were removed
    monkeypatch.setenv('CC', str(tmp_path / 'no-such-compiler'))
    native.load_native.cache_clear()
    with pytest.warns(RuntimeWarning, match='no such command'):
        assert native.load_native(SOURCE) is None


def _cached(cache, compiler: str = 'cc', arch: tuple[str, ...] = native._ARCH_FLAGS[0]) -> native.Path:
    """Where load_native keeps the layers' kernel built by ``compiler`` for this CPU."""
    compiler = shutil.which(compiler)
    return native._library_path(native.Path(cache), native._PACKAGE / SOURCE, native._compiler_version(compiler),
                                native._FLAGS + arch)


def test_the_library_is_built_once_per_cpu_and_rebuilt_when_damaged(tmp_path, monkeypatch):
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(tmp_path / 'cache'))
    monkeypatch.setenv('CC', _fake_compiler(tmp_path, 'exec cc "$@"'))
    builds = tmp_path / 'builds'
    assert _kernel() is not None and builds.read_text().count('build') == 1
    native.load_native.cache_clear()
    assert _kernel() is not None and builds.read_text().count('build') == 1  # a second process: from the cache
    library = _cached(tmp_path / 'cache', os.environ['CC'])
    assert sorted(p.name for p in (tmp_path / 'cache').iterdir()) == [library.name, library.name + '.sha256']
    monkeypatch.setattr(native, '_cpu_identity', lambda: 'another CPU')  # a shared home folder, another machine
    native.load_native.cache_clear()
    assert _kernel() is not None and builds.read_text().count('build') == 2
    assert len(list((tmp_path / 'cache').iterdir())) == 4
    # Damaged bytes (a new file: this process keeps the loaded one mapped): not what was built, so not loaded; built
    # again in place, and said.
    library = _cached(tmp_path / 'cache', os.environ['CC'])
    library.unlink()
    library.write_bytes(b'not a shared library')
    native.load_native.cache_clear()
    with pytest.warns(RuntimeWarning, match='does not have the SHA-256 recorded when it was built; its C kernel '
                                            'fastpath/cpu_kernels.c was built again, in its place'):
        assert _kernel() is not None
    assert builds.read_text().count('build') == 3
    # A library that passes every check and still does not load (damaged before its hash was recorded): removed.
    monkeypatch.setattr(native, '_cpu_identity', lambda: 'a third CPU')
    library = _cached(tmp_path / 'cache', os.environ['CC'])
    library.write_bytes(b'not a shared library either')
    (library.parent / (library.name + '.sha256')).write_text(hashlib.sha256(library.read_bytes()).hexdigest())
    native.load_native.cache_clear()
    with pytest.warns(RuntimeWarning, match='could not build or load'):
        assert native.load_native(SOURCE) is None
    assert not library.exists()
    native.load_native.cache_clear()
    assert _kernel() is not None and library.exists()


# A library with the kernel's name that, loaded, leaves a mark (its constructor runs at load).
_PLANTED = r"""
#include <stdio.h>
#include <stdlib.h>
__attribute__((constructor)) static void planted(void) {
    FILE *mark = fopen(getenv("PLANTED_MARK"), "w");
    if (mark) fclose(mark);
}
int channel_block(void) { return 8; }
"""


def _plant(tmp_path, library: native.Path, owner: int | None = None, mode: int = 0o755) -> None:
    """Put a library of someone else's making where load_native looks, with the hash record it would need."""
    (tmp_path / 'planted.c').write_text(_PLANTED)
    subprocess.run(['cc', '-shared', '-fPIC', str(tmp_path / 'planted.c'), '-o', str(library)], check=True)
    (library.parent / (library.name + '.sha256')).write_text(hashlib.sha256(library.read_bytes()).hexdigest())
    os.chmod(library, mode)
    if owner is not None:
        os.chown(library, owner, owner)
        os.chown(library.parent / (library.name + '.sha256'), owner, owner)


def _nobody() -> int:
    import pwd
    try:
        nobody = pwd.getpwnam('nobody').pw_uid
    except KeyError:
        pytest.skip('no user nobody')
    if os.geteuid() != 0:
        pytest.skip('giving a file to another user takes root')
    return nobody


@pytest.mark.parametrize('case', ['library of another user', 'library writable by its group', 'library not as built',
                                  'folder of another user', 'folder writable by all'])
def test_a_library_someone_else_could_have_written_is_never_loaded(case, tmp_path, monkeypatch):
    """The kernel's cached file planted by another user (chown nobody), or open to other writers, or bytes other than
    the build's: never loaded (its constructor would run), whatever hash record sits beside it; one warning names the
    check and LIPSFORMER_CACHE_DIR, and the kernels still come from a build of this process's own."""
    cache = tmp_path / 'cache'
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(cache))
    monkeypatch.setenv('PLANTED_MARK', str(tmp_path / 'planted-code-ran'))
    monkeypatch.setattr(native, '_ARCH_FLAGS', (native._ARCH_FLAGS[0],))
    library = _cached(cache)
    if case == 'library not as built':
        _kernel()  # this user's build and its record
        library.unlink()
        _plant(tmp_path, library)
        (library.parent / (library.name + '.sha256')).write_text('0' * 64)
        native.load_native.cache_clear()
    else:
        cache.mkdir()
        _plant(tmp_path, library, owner=_nobody() if case.endswith('of another user') else None,
               mode=0o775 if case == 'library writable by its group' else 0o755)
    if case == 'folder of another user':
        os.chown(cache, _nobody(), _nobody())
    elif case == 'folder writable by all':
        os.chmod(cache, 0o777)  # the cache of a process with umask 000 before this check existed
    expected = {
        'library of another user': f'the cached library {library} belongs to nobody .uid {_nobody_uid()}., not to '
                                   f'this user',
        'library writable by its group': f'the cached library {library} can be written by its group .mode 775.; its C '
                                         f'kernel fastpath/cpu_kernels.c was built again, in its place',
        'library not as built': f'the cached library {library} does not have the SHA-256 recorded when it was built',
        'folder of another user': f'the kernel cache folder {cache} belongs to nobody .uid {_nobody_uid()}., not to '
                                  f'this user, .*, so nothing in it is loaded; its C kernel fastpath/cpu_kernels.c was '
                                  f'built in a private temporary folder',
        'folder writable by all': f'the kernel cache folder {cache} can be written by its group and other users .mode '
                                  f'777., so nothing in it is loaded',
    }[case]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter('always')
        library_loaded = native.load_native(SOURCE)
    assert not (tmp_path / 'planted-code-ran').exists(), 'the planted library was loaded: its code ran'
    assert library_loaded is not None and library_loaded.channel_block() in (8, 16)
    assert len(caught) == 1 and re.search(expected, str(caught[0].message)), [str(w.message) for w in caught]
    assert 'Set LIPSFORMER_CACHE_DIR to a folder of your own' in str(caught[0].message)
    assert 'Set CC' not in str(caught[0].message)


def _nobody_uid() -> int:
    import pwd
    try:
        return pwd.getpwnam('nobody').pw_uid
    except KeyError:
        return -1


def test_the_cache_folder_and_the_parents_it_makes_are_private_whatever_the_umask(tmp_path, monkeypatch):
    cache = tmp_path / 'home' / '.cache' / 'lipsformer'
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(cache))
    umask = os.umask(0)  # files and folders would be made writable by everyone
    try:
        _kernel()
    finally:
        os.umask(umask)
    for folder in (tmp_path / 'home', tmp_path / 'home' / '.cache', cache):
        assert stat.S_IMODE(folder.stat().st_mode) == 0o700, folder
    for built in cache.iterdir():
        assert not built.stat().st_mode & 0o022, built


def test_a_cache_folder_that_cannot_be_written_builds_privately_and_says_which_variable(tmp_path, monkeypatch):
    cache = tmp_path / 'cache'
    cache.mkdir(mode=0o500)
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(cache))
    read_only = os.geteuid() != 0 or subprocess.run(['chattr', '+i', str(cache)], capture_output=True).returncode == 0
    if not read_only:
        pytest.skip('root writes any folder; making one read-only needs chattr +i')
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter('always')
            assert native.load_native(SOURCE) is not None
    finally:
        if os.geteuid() == 0:
            subprocess.run(['chattr', '-i', str(cache)], check=True)
    assert len(caught) == 1, [str(w.message) for w in caught]
    message = str(caught[0].message)
    assert re.search(f'the kernel cache folder {cache} cannot be written .(Permission denied|Operation not permitted|'
                     f'Read-only file system).; its C kernel fastpath/cpu_kernels.c was built in a private temporary '
                     f'folder', message), message
    assert 'Set LIPSFORMER_CACHE_DIR' in message and 'Set CC' not in message and list(cache.iterdir()) == []


def test_a_compiler_that_fails_without_a_word_still_gets_a_reason(tmp_path, monkeypatch):
    monkeypatch.setenv('LIPSFORMER_CACHE_DIR', str(tmp_path / 'cache'))
    monkeypatch.setenv('CC', '/bin/false')
    with pytest.warns(RuntimeWarning, match=r'could not build or load its C kernel fastpath/cpu_kernels.c with '
                                            r'/\S*false \(/\S*false exited with status 1 and printed nothing\)'):
        assert native.load_native(SOURCE) is None


def test_a_double_backward_gets_the_second_derivatives_of_the_convolution():
    # The backward that builds a graph takes the differentiable per-image path; the C kernel's output has no graph.
    _kernel()
    x = torch.randn(2, 6, 6, 16, requires_grad=True)
    weight = torch.randn(16, 1, 7, 7, requires_grad=True)

    def second_order(conv):
        (weight_grad,) = torch.autograd.grad(conv(x, weight).square().sum(), weight, create_graph=True)
        return torch.autograd.grad(weight_grad.sum(), x)[0]

    got = second_order(lambda x, weight: depthwise_conv._DepthwiseConv2d.apply(x, weight, None, (3, 3)))
    expected = second_order(lambda x, weight: F.conv2d(x.permute(0, 3, 1, 2), weight, padding=3, groups=16))
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * expected.abs().max().item())


@pytest.mark.parametrize('shape, scale_shape', [
    ((4, 14, 14, 64), (4, 1, 1, 64)),  # alpha times drop path's per-image keep mask
    ((2, 7, 9, 48), (48,)),  # alpha alone
    ((3, 300, 32), (3, 1, 32)),  # tokens: more positions than a chunk of the kernel
])
def test_the_gelu_residual_backward_takes_the_kernel_and_gives_the_float64_gradients(shape, scale_shape, monkeypatch):
    from lipsformer.fastpath import lean_autograd
    calls = []
    monkeypatch.setattr(lean_autograd, 'cpu_kernels', lambda *t, real=lean_autograd.cpu_kernels: calls.append(
        real(*t)) or calls[-1])
    x = torch.randn(shape, requires_grad=True)
    z = torch.cat([4 * torch.randn(shape).flatten()[:-6], torch.tensor([0.0, -30.0, 30.0, -100.0, 1e-30, -5.5])]
                  ).view(shape).requires_grad_(True)  # GELU's tails, its zero, exp's underflow
    scale = torch.rand(scale_shape, requires_grad=True)
    grad = torch.randn(shape)
    got = torch.autograd.grad(lean_autograd.gelu_residual(x, z, scale), (x, z, scale), grad)
    assert calls and calls[-1] is not None  # the C kernel ran
    reference = torch.addcmul(x.double(), F.gelu(z.double()), scale.double())
    expected = torch.autograd.grad(reference, (x, z, scale), grad.double())
    for name, g, e in zip(('x', 'z', 'scale'), got, expected):
        torch.testing.assert_close(g.double(), e.double(), rtol=1e-5, atol=2e-6 * e.abs().max().item(),
                                   msg=lambda text, name=name: f'{name}: {text}')


def test_the_gelu_residual_backward_propagates_nan_as_pytorch_does():
    from lipsformer.fastpath.lean_autograd import _native_gelu_residual_backward
    z = torch.randn(2, 3, 3, 16)
    z[0, 1, 2, 5] = float('nan')
    with torch.no_grad():  # as in a backward
        grad_z, grad_scale = _native_gelu_residual_backward(torch.ones_like(z), z, torch.ones(16))
    assert grad_z.isnan().sum() == 1 and grad_z[0, 1, 2, 5].isnan()
    assert grad_scale.isnan().sum() == 1 and grad_scale[5].isnan()


@pytest.mark.skipif(not os.path.exists('/proc/self/maps'), reason='finds the OpenMP runtime through /proc (Linux)')
def test_the_kernels_run_on_torch_openmp_team_and_give_what_posix_threads_give():
    library = _kernel()
    if 'ATen parallel backend: OpenMP' in torch.__config__.parallel_info():
        runtime = native._torch_openmp()
        assert runtime is not None and os.path.dirname(runtime._name).startswith(os.path.dirname(torch.__file__))
    x, grad = torch.randn(5, 9, 11, 32), torch.randn(5, 9, 11, 32)
    with torch.no_grad():
        team = depthwise_conv._native_weight_grad(library, x, grad)
        library.use_openmp(None, None, None)  # POSIX threads
        try:
            posix = depthwise_conv._native_weight_grad(library, x, grad)
        finally:
            native._hand_over_openmp(library)
    assert torch.equal(team, posix)  # the same items, each summed in the same order
    _assert_close_to_reference(team, x, grad)
