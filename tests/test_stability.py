"""The stability experiment: every arm end to end on a tiny config, resumption, locking, divergence, the report."""
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lipsformer.experiments.stability import experiment_command
from lipsformer.experiments.stability.arms import ARMS, ModelShape, build_model
from lipsformer.experiments.stability.grid import claim, release, run_dir, run_grid
from lipsformer.experiments.stability.report import END, START, steps_to_loss, write_report
from lipsformer.experiments.stability.subsets import Batches, balanced_indices, load_subsets, synthetic_subsets
from lipsformer.experiments.stability.training_run import RunFiles, RunSettings, train_run

TINY = RunSettings(steps=2, batch_size=8, train_size=40, test_size=20, bound_every=1, checkpoint_every=1,
                   log_every=1, synthetic=True, shape=ModelShape(embed_dim=8, depths=(1, 1, 1, 1)))
CPU = torch.device('cpu')


@pytest.fixture(scope='module')
def subsets():
    return synthetic_subsets(TINY.train_size, TINY.test_size)


def _train(tmp_path, subsets, arm='lipsformer', lr=1e-3, seed=0, settings=TINY):
    files = RunFiles(run_dir(tmp_path, arm, lr, seed))
    files.directory.mkdir(parents=True, exist_ok=True)
    return train_run(ARMS[arm], lr, seed, settings, subsets, files, CPU), files


def test_the_arms_swap_one_component_each_or_all():
    full = ARMS['lipsformer'].model_options
    for name, swapped in [('layernorm', {'norm_layer'}), ('dot_product', {'attn_type'}),
                          ('trunc_normal_init', {'weight_init'}), ('no_conv_shortcuts', {'conv_config'}),
                          ('alpha_fixed_1', {'alpha_init', 'alpha_learnable'})]:
        assert {k for k, v in ARMS[name].model_options.items() if full[k] != v} == swapped
    post, pre = ARMS['post_norm_transformer'].model_options, ARMS['pre_norm_transformer'].model_options
    assert {k for k in full if full[k] != post[k]} == {'norm_layer', 'attn_type', 'weight_init', 'alpha_init',
                                                       'alpha_learnable', 'conv_config'}
    assert {k for k in post if post[k] != pre[k]} == {'norm_position'}
    assert ARMS['lipsformer_warmup'].model_options == full and ARMS['lipsformer_warmup'].warmup_epochs == 5
    assert sum(ModelShape().depths) >= 24


@pytest.mark.parametrize('arm', ARMS)
def test_every_arm_runs_two_steps_and_records_everything(tmp_path, subsets, arm):
    result, files = _train(tmp_path, subsets, arm)
    assert not result['diverged'] and 0.0 <= result['test_accuracy'] <= 1.0
    assert json.loads(files.result.read_text())['arm'] == arm and not files.checkpoint.exists()
    steps = files.read_steps()
    assert [r['step'] for r in steps] == [1, 2]
    for record in steps:
        assert all(math.isfinite(record[k]) for k in ('loss', 'grad_norm', 'max_activation_norm', 'lr'))
        assert math.isfinite(record['log10_bounded_parts'])  # bound_every=1
    assert result['warmup_steps'] == (1 if arm == 'lipsformer_warmup' else 0)  # 5 epochs cut to fit 2 steps


def test_an_interrupted_run_resumes_from_its_checkpoint_and_matches_an_uninterrupted_one(tmp_path, subsets,
                                                                                        monkeypatch):
    settings = RunSettings(**{**TINY.__dict__, 'steps': 4, 'checkpoint_every': 2})
    reference, reference_files = _train(tmp_path / 'reference', subsets, settings=settings)

    original = Batches.__call__

    def interrupt_at_step_4(self, step):
        if step == 3:
            raise KeyboardInterrupt
        return original(self, step)

    monkeypatch.setattr(Batches, '__call__', interrupt_at_step_4)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path / 'resumed', subsets, settings=settings)
    files = RunFiles(run_dir(tmp_path / 'resumed', 'lipsformer', 1e-3, 0))
    assert [r['step'] for r in files.read_steps()] == [1, 2, 3]  # step 3 is past the checkpoint at step 2
    assert torch.load(files.checkpoint, weights_only=True)['step'] == 2
    monkeypatch.setattr(Batches, '__call__', original)
    resumed, _ = _train(tmp_path / 'resumed', subsets, settings=settings)
    assert [r['loss'] for r in files.read_steps()] == [r['loss'] for r in reference_files.read_steps()]
    assert resumed['test_accuracy'] == reference['test_accuracy']


def test_resuming_with_other_settings_is_refused(tmp_path, subsets):
    _train(tmp_path, subsets)
    with pytest.raises(ValueError, match='other settings'):
        _train(tmp_path, subsets, settings=RunSettings(**{**TINY.__dict__, 'steps': 3}))


def _dead_pid():
    child = subprocess.Popen([sys.executable, '-c', ''])
    child.wait()
    return child.pid


def test_a_lock_prevents_a_second_claim_and_a_stale_lock_is_taken_over(tmp_path):
    directory = tmp_path / 'run'
    assert claim(directory)
    assert not claim(directory)  # held by a live process (this one)
    release(directory)
    assert not (directory / 'lock').exists()
    (directory / 'lock').write_text(str(_dead_pid()))
    assert claim(directory)
    assert (directory / 'lock').read_text() == str(os.getpid())
    assert list(directory.iterdir()) == [directory / 'lock']


def test_the_grid_skips_runs_locked_by_a_live_process_and_finished_runs(tmp_path, subsets):
    locked = run_dir(tmp_path, 'lipsformer', 1e-3, 1)
    locked.mkdir(parents=True)
    (locked / 'lock').write_text(str(os.getppid()))
    assert run_grid(tmp_path, ['lipsformer'], [1e-3], [0, 1], TINY, subsets, CPU) == 1
    assert not RunFiles(locked).done() and RunFiles(run_dir(tmp_path, 'lipsformer', 1e-3, 0)).done()
    assert run_grid(tmp_path, ['lipsformer'], [1e-3], [0], TINY, subsets, CPU) == 0


def test_a_non_finite_loss_stops_the_run_as_diverged_at_that_step(tmp_path, subsets, monkeypatch):
    original = Batches.__call__

    def nan_images_at_step_2(self, step):
        images, labels = original(self, step)
        return (images * math.nan if step == 1 else images), labels

    monkeypatch.setattr(Batches, '__call__', nan_images_at_step_2)
    settings = RunSettings(**{**TINY.__dict__, 'steps': 4})
    result, files = _train(tmp_path, subsets, settings=settings)
    assert result['diverged'] and result['diverged_step'] == 2 and 'test_accuracy' not in result
    steps = files.read_steps()
    assert [r['step'] for r in steps] == [1, 2] and steps[-1]['loss'] is None and steps[-1]['diverged']


def test_a_huge_learning_rate_diverges(tmp_path, subsets):
    result, _ = _train(tmp_path, subsets, arm='post_norm_transformer', lr=1e30,
                       settings=RunSettings(**{**TINY.__dict__, 'steps': 6}))
    assert result['diverged'] and 1 < result['diverged_step'] <= 6


def test_batches_are_a_function_of_seed_and_step(subsets):
    batches = Batches(subsets, 8, seed=3)
    assert batches.steps_per_epoch == 5
    torch.testing.assert_close(batches(7), Batches(subsets, 8, seed=3)(7))
    assert not torch.equal(batches(7)[0], Batches(subsets, 8, seed=4)(7)[0])
    epoch = torch.cat([batches(step)[1] for step in range(5)])
    assert sorted(epoch.tolist()) == sorted(subsets.train_labels.tolist())  # an epoch is a permutation


def test_balanced_subset():
    labels = torch.arange(1000) % 10
    chosen = balanced_indices(labels, 50)
    assert torch.bincount(labels[chosen]).tolist() == [5] * 10 and len(set(chosen.tolist())) == 50
    torch.testing.assert_close(chosen, balanced_indices(labels, 50))
    with pytest.raises(ValueError, match='multiple of 10'):
        balanced_indices(labels, 55)


@pytest.mark.skipif(not os.path.isdir('/usr/share/datasets/fashion-mnist'), reason='Debian Fashion-MNIST absent')
def test_real_fashion_mnist_subsets_are_padded_normalised_and_balanced(tmp_path):
    data = load_subsets(str(tmp_path), 100, 50)
    assert data.train_images.shape == (100, 1, 32, 32) and data.test_images.shape == (50, 1, 32, 32)
    assert torch.bincount(data.train_labels).tolist() == [10] * 10
    background = (0.0 - 0.2860) / 0.3530
    torch.testing.assert_close(data.train_images[..., :2, :], torch.full_like(data.train_images[..., :2, :],
                                                                              background))


def test_the_model_shape_has_the_documented_size():
    model = build_model(ARMS['lipsformer'], ModelShape())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.6e6, rel=0.01)
    assert len([b for s in model.stages for b in s.blocks]) == 25


def _fake_run(out, arm, lr, seed, losses, diverged_step=None):
    files = RunFiles(run_dir(out, arm, lr, seed))
    files.directory.mkdir(parents=True)
    files.append_steps([{'step': i + 1, 'loss': loss, 'grad_norm': 1.0 + i, 'max_activation_norm': 3.0,
                         'lr': lr, **({'log10_bounded_parts': 2.0 + i} if i % 2 == 0 else {})}
                        for i, loss in enumerate(losses)])
    result = {'arm': arm, 'lr': lr, 'seed': seed, 'diverged': diverged_step is not None,
              'diverged_step': diverged_step, 'settings': TINY.as_dict(), 'steps_per_epoch': 5,
              'seconds': {'train': 10.0, 'bound': 1.0, 'eval': 1.0, 'total': 12.0}, 'finished_at': 1000.0 + seed,
              'machine': {'device': 'test cpu', 'threads': 1, 'torch': torch.__version__}}
    if diverged_step is None:
        result.update(test_accuracy=0.8 + seed / 100, final_lipschitz={'log10_bounded_parts': 5.0})
    files.result.write_text(json.dumps(result))


def test_the_report_writes_the_table_between_markers_and_the_plots(tmp_path):
    out, docs = tmp_path / 'runs', tmp_path / 'docs'
    for seed in (0, 1):
        _fake_run(out, 'lipsformer', 2e-3, seed, [2.0, 1.0, 0.5, 0.4] * 10)
        _fake_run(out, 'post_norm_transformer', 1e-2, seed, [2.0, 3.0], diverged_step=3 if seed else None)
    docs.mkdir()
    (docs / 'stability.md').write_text(f'# Title\n\nintro kept\n\n{START}\nold table\n{END}\n\nanalysis kept\n')
    write_report(out, docs)
    text = (docs / 'stability.md').read_text()
    assert 'intro kept' in text and 'analysis kept' in text and 'old table' not in text
    assert '| lipsformer | 0.002 | 0/2 | 80.5 ± 0.7 |' in text
    assert '| post_norm_transformer | 0.01 | 1/2 (seed 1 at step 3) | 80.0 | never (0/2) |' in text
    assert 'test cpu, 1 thread(s)' in text
    for name in ('stability_loss.png', 'stability_grad_norm.png', 'stability_lipschitz.png'):
        assert (docs / name).read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    write_report(out, docs)  # regenerating keeps the page's shape
    assert (docs / 'stability.md').read_text().count(START) == 1


def test_steps_to_loss_uses_the_smoothed_loss():
    records = [{'step': i + 1, 'loss': loss} for i, loss in enumerate([1.0] * 5 + [0.1] * 30)]
    # Steps 4-7 average 0.55, steps 5-8 0.325.
    assert steps_to_loss(records, threshold=0.5, window=4) == 8
    assert steps_to_loss(records[:5], threshold=0.5, window=4) is None


def test_the_command_line_runs_the_grid_and_the_report(tmp_path):
    tiny = ['--steps', '2', '--batch-size', '8', '--train-size', '40', '--test-size', '20', '--embed-dim', '8',
            '--depths', '1,1,1,1', '--synthetic', '--bound-every', '1']
    experiment_command.main(['--out', str(tmp_path / 'runs'), '--arms', 'pre_norm_transformer', '--lrs', '1e-3',
                             '--seeds', '0', *tiny])
    assert RunFiles(run_dir(tmp_path / 'runs', 'pre_norm_transformer', 1e-3, 0)).done()
    experiment_command.main(['--out', str(tmp_path / 'runs'), '--report', str(tmp_path / 'docs')])
    assert '| pre_norm_transformer | 0.001 | 0/1 |' in (tmp_path / 'docs' / 'stability.md').read_text()
    with pytest.raises(SystemExit):
        experiment_command.main(['--out', str(tmp_path), '--arms', 'resnet'])
