"""The stability experiment: every arm end to end on a tiny config, resumption, locking, divergence, the queue, the
results file, the report from it, and an image folder as the data."""
import json
import logging
import math
import os
import signal
import socket

import pytest
import torch
from PIL import Image
from process_support import hold_lock

from lipsformer.instruments.stability import experiment_command, grid
from lipsformer.instruments.stability.arms import ARMS, WARMUP_ARM, ModelShape, build_arm_model
from lipsformer.instruments.stability.grid import queue, run_dir, run_grid
from lipsformer.instruments.stability.report import (
    classify,
    markers,
    outright_failure,
    stable_rates,
    write_stability_report,
)
from lipsformer.instruments.stability.subsets import (
    Batches,
    balanced_indices,
    load_image_folder,
    load_subsets,
    synthetic_subsets,
)
from lipsformer.instruments.stability.sweep_results import Results, collect, compact_record, read_results, steps_to_loss
from lipsformer.instruments.stability.training_run import RunFiles, RunSettings, train_run
from lipsformer.training.run_lock import LOCK_FILE, RunFolderInUseError, RunLock
from lipsformer.utils.io import write_json

TINY = RunSettings(steps=2, batch_size=8, train_size=40, test_size=20, bound_every=1, eval_every=1,
                   checkpoint_every=1, log_every=1, synthetic=True, dataset='tiny',
                   shape=ModelShape(embed_dim=8, depths=(1, 1, 1, 1)))
TINY_ARGS = ['--steps', '2', '--batch-size', '8', '--train-size', '40', '--test-size', '20', '--embed-dim', '8',
             '--depths', '1,1,1,1', '--bound-every', '1', '--eval-every', '1']
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
    # The standard Transformers with the same warmup as LipsFormer's warmup arm, the models otherwise unchanged.
    assert WARMUP_ARM == {'lipsformer': 'lipsformer_warmup', 'post_norm_transformer': 'post_norm_transformer_warmup',
                          'pre_norm_transformer': 'pre_norm_transformer_warmup'}
    for arm, warm in WARMUP_ARM.items():
        assert ARMS[warm].model_options == ARMS[arm].model_options and ARMS[arm].warmup_epochs == 0
        assert ARMS[warm].warmup_epochs == ARMS['lipsformer_warmup'].warmup_epochs
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
    assert result['warmup_steps'] == (1 if ARMS[arm].warmup_epochs else 0)  # 5 epochs cut to fit 2 steps
    # The test accuracy of the weights each step starts from (eval_every=1), then of the final weights.
    assert result['test_curve'] == [[0, steps[0]['test_accuracy']], [1, steps[1]['test_accuracy']],
                                    [2, result['test_accuracy']]]
    assert result['torch'] == torch.__version__ and result['machine']['threads'] == torch.get_num_threads()
    assert {'name', 'family', 'model'} <= set(result['machine']['cpu'])


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
    assert resumed['test_curve'] == reference['test_curve'] and len(resumed['test_curve']) == 5
    assert 0 < resumed['seconds']['cpu'] and set(resumed['seconds']) == {'train', 'bound', 'eval', 'total', 'cpu'}


def test_by_default_the_bound_is_measured_at_the_first_step_and_at_the_end_only(tmp_path, subsets):
    settings = RunSettings(**{**TINY.__dict__, 'steps': 3, 'bound_every': RunSettings().bound_every})
    result, files = _train(tmp_path, subsets, settings=settings)
    assert [('log10_bounded_parts' in r) for r in files.read_steps()] == [True, False, False]
    assert math.isfinite(result['final_lipschitz']['log10_bounded_parts'])
    every_2 = RunSettings(**{**TINY.__dict__, 'steps': 3, 'bound_every': 2})
    _, files = _train(tmp_path / 'every_2', subsets, settings=every_2)
    assert [('log10_bounded_parts' in r) for r in files.read_steps()] == [True, False, True]


def test_resuming_with_other_settings_is_refused(tmp_path, subsets):
    _train(tmp_path, subsets)
    with pytest.raises(ValueError, match='other settings'):
        _train(tmp_path, subsets, settings=RunSettings(**{**TINY.__dict__, 'steps': 3}))


def test_a_run_held_by_a_live_runner_is_refused_and_a_killed_runner_leaves_nothing_that_refuses(tmp_path, subsets,
                                                                                               caplog):
    directory = run_dir(tmp_path, 'lipsformer', 1e-3, 0)
    holder = hold_lock(str(directory), str(tmp_path / 'release'))  # another runner, alive until killed
    try:
        with caplog.at_level(logging.INFO, logger=grid.__name__):
            assert run_grid(tmp_path, ['lipsformer'], [1e-3], [0], TINY, subsets, CPU) == 0
        assert not RunFiles(directory).done()
        assert f'lipsformer lr 0.001 seed 0: left to the runner that holds it, process {holder.pid} on host ' \
               f'{socket.gethostname()}' in caplog.text
        with pytest.raises(RunFolderInUseError, match=f'in use by process {holder.pid}'):
            RunLock(str(directory)).acquire()  # one lock for the grid and train.py: a train.py start is refused too
    finally:
        holder.send_signal(signal.SIGKILL)
        holder.wait()
    # A runner killed mid-run leaves no lock that holds (the kernel lets its flock go): the next one takes the run.
    assert run_grid(tmp_path, ['lipsformer'], [1e-3], [0], TINY, subsets, CPU) == 1
    assert RunFiles(directory).done()


def test_the_queue_runs_one_seed_of_every_cell_before_the_next_seed():
    order = queue(['a', 'b'], [1e-3, 2e-3], [0, 1, 2])
    assert order[:4] == [('a', 1e-3, 0), ('b', 1e-3, 0), ('a', 2e-3, 0), ('b', 2e-3, 0)]
    assert [seed for _, _, seed in order] == [0] * 4 + [1] * 4 + [2] * 4
    # Each arm's rates in ascending order whatever order they were given in, so that pruning can act.
    assert queue(['a'], [4e-3, 1e-3, 2e-3], [0]) == [('a', 1e-3, 0), ('a', 2e-3, 0), ('a', 4e-3, 0)]


def test_runs_of_another_torch_version_have_folders_of_their_own(tmp_path):
    assert run_dir(tmp_path, 'lipsformer', 2e-3, 0) == (tmp_path / f'torch-{torch.__version__}' / 'lipsformer' /
                                                         'lr0.002' / 'seed0')
    assert run_dir(tmp_path, 'lipsformer', 2e-3, 0, '2.6.0') != run_dir(tmp_path, 'lipsformer', 2e-3, 0)


def test_the_grid_skips_runs_locked_by_a_live_process_and_finished_runs(tmp_path, subsets):
    locked = run_dir(tmp_path, 'lipsformer', 1e-3, 1)
    with RunLock(str(locked)):  # held as another runner holds it (a flock of another open file)
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
    assert len(balanced_indices(labels, 55)) == 50  # an equal share per class (a warning says so)
    thirds = labels % 3
    assert torch.bincount(thirds[balanced_indices(thirds, 7, num_classes=3)]).tolist() == [2, 2, 2]
    with pytest.raises(ValueError, match='--train-size 5 is less than one image'):
        balanced_indices(labels, 5, option='--train-size')
    with pytest.raises(ValueError, match=r'class\(es\) \[9\] have only 1: use --test-size 10 or less'):
        balanced_indices(torch.tensor([*range(10)] * 1 + [*range(9)] * 3), 30, option='--test-size')


@pytest.mark.skipif(not os.path.isdir('/usr/share/datasets/fashion-mnist'), reason='Debian Fashion-MNIST absent')
def test_real_fashion_mnist_subsets_are_padded_normalised_and_balanced(tmp_path):
    data = load_subsets(str(tmp_path), 100, 50)
    assert data.train_images.shape == (100, 1, 32, 32) and data.test_images.shape == (50, 1, 32, 32)
    assert torch.bincount(data.train_labels).tolist() == [10] * 10
    background = (0.0 - 0.2860) / 0.3530
    torch.testing.assert_close(data.train_images[..., :2, :], torch.full_like(data.train_images[..., :2, :],
                                                                              background))


def test_the_model_shape_has_the_documented_size():
    model = build_arm_model(ARMS['lipsformer'], ModelShape())
    assert sum(p.numel() for p in model.parameters()) == pytest.approx(1.6e6, rel=0.01)
    assert len([b for s in model.stages for b in s.blocks]) == 25


def test_collect_merges_finished_runs_into_the_results_file_by_key(tmp_path, subsets):
    out, results = tmp_path / 'runs', tmp_path / 'results' / 'tiny.jsonl'
    _train(out, subsets, seed=0)
    _train(out, subsets, arm='post_norm_transformer', lr=1e30, settings=RunSettings(**{**TINY.__dict__,
                                                                                       'steps': 6}))
    with pytest.raises(ValueError, match='other settings|collect it into another'):
        collect(out, results)  # the 6-step run is another sweep
    for path in (out / f'torch-{torch.__version__}' / 'post_norm_transformer').rglob('*'):
        if path.is_file():
            path.unlink()
    # A run of another torch version, merged from another machine's file, is kept beside this one's.
    other = dict(arm='lipsformer', lr=1e-3, seed=0, warmup_epochs=0, torch='2.6.0+cpu', final_accuracy=0.5)
    results.parent.mkdir()
    results.write_text(json.dumps({'settings': TINY.as_dict()}) + '\n' + json.dumps(other) + '\n')
    assert collect(out, results) == (1, 0)
    found = read_results(results)
    assert found.settings == TINY.as_dict() and len(found.records) == 2
    mine = next(r for r in found.records if r['torch'] == torch.__version__)
    run = json.loads(RunFiles(run_dir(out, 'lipsformer', 1e-3, 0)).result.read_text())
    assert mine['final_accuracy'] == round(run['test_accuracy'], 4) and mine['diverged_step'] is None
    assert mine['best_accuracy'] == max(a for _, a in mine['curve']) and len(mine['curve']) == 3
    assert mine['cpu'] == run['machine']['cpu'] and mine['threads'] == run['machine']['threads']
    assert results.read_text().count('\n') == 3  # one line of settings, one line per run
    assert collect(out, results) == (0, 0)  # collecting again changes nothing
    assert len(read_results(results).records) == 2


def _fake_result(arm, lr, seed, settings, final=None, diverged_step=None):
    """A run's result.json as train_run writes it, with the given outcome."""
    curve = [[0, 0.1], *([[settings.steps, final]] if final is not None else [])]
    machine = {'cpu': {'name': 'Test CPU', 'family': '6', 'model': '85'}, 'threads': 1, 'torch': torch.__version__}
    result = dict(arm=arm, lr=lr, seed=seed, settings=settings.as_dict(), model_options=ARMS[arm].model_options,
                  warmup_epochs=ARMS[arm].warmup_epochs, torch=torch.__version__, diverged=diverged_step is not None,
                  diverged_step=diverged_step, test_curve=curve, seconds={'total': 1.0, 'cpu': 1.0}, finished_at=0.0,
                  machine=machine, machines=[machine])
    if final is not None:
        result['test_accuracy'] = final
    return result


# Outcomes by (lr, seed): a final accuracy, or a divergence step. Seed 0 diverges at 0.002 and is stuck at chance at
# 0.004: its higher rates are left out. Seed 1 fails at two rates that are not consecutive; seed 2 is degraded
# (relative to the arm's best, unknown in advance) at two rates: both are run everywhere.
OUTCOMES = {(0.001, 0): 0.8, (0.002, 0): 'diverged', (0.004, 0): 0.1, (0.001, 1): 'diverged', (0.002, 1): 0.8,
            (0.004, 1): 0.1, (0.008, 1): 0.8, (0.002, 2): 0.5, (0.004, 2): 0.5}
PRUNE_LRS = [0.016, 0.001, 0.008, 0.002, 0.004]  # the queue sorts them


def _fake_training(trained, outcomes=OUTCOMES):
    def train(arm, lr, seed, settings, subsets, files, device):
        trained.append((lr, seed))
        outcome = outcomes.get((lr, seed), 0.8)
        result = _fake_result(arm.name, lr, seed, settings, *((None, 7) if outcome == 'diverged' else (outcome,)))
        write_json(files.result, result)
        return result
    return train


def test_a_seed_that_failed_at_two_consecutive_rates_is_not_run_at_higher_ones(tmp_path, subsets, monkeypatch):
    trained = []
    monkeypatch.setattr(grid, 'train_run', _fake_training(trained))
    # A run another live runner has already started is left to it, pruned or not.
    busy = run_dir(tmp_path, 'lipsformer', 0.016, 0)
    busy_lock = RunLock(str(busy))
    busy_lock.acquire()
    assert run_grid(tmp_path, ['lipsformer'], PRUNE_LRS, [0, 1, 2], TINY, subsets, CPU, stop_after_failures=2) == 13
    assert trained == [(0.001, 0), (0.002, 0), (0.004, 0)] + [(lr, seed) for seed in (1, 2) for lr in sorted(PRUNE_LRS)]
    marker = json.loads(RunFiles(run_dir(tmp_path, 'lipsformer', 0.008, 0)).not_run.read_text())
    assert marker['not_run'] == {'stop_after_failures': 2, 'failed_at': [0.002, 0.004]}
    assert marker['settings'] == TINY.as_dict()
    assert (marker['arm'], marker['lr'], marker['seed'], marker['torch']) == ('lipsformer', 0.008, 0, torch.__version__)
    assert not RunFiles(busy).not_run.exists() and not RunFiles(busy).done()
    busy_lock.release()
    # Once that runner is gone the run is left out too; nothing else changes.
    assert run_grid(tmp_path, ['lipsformer'], PRUNE_LRS, [0, 1, 2], TINY, subsets, CPU, stop_after_failures=2) == 0
    assert RunFiles(busy).not_run.exists() and len(trained) == 13
    # Three failures in a row are needed with 3; 0 runs the full grid, and a run no longer left out loses its marker.
    assert run_grid(tmp_path, ['lipsformer'], PRUNE_LRS, [0], TINY, subsets, CPU, stop_after_failures=3) == 2
    assert trained[-2:] == [(0.008, 0), (0.016, 0)] and not RunFiles(busy).not_run.exists()
    assert not list(tmp_path.rglob('not_run.json'))
    assert all(not lock.read_text() for lock in tmp_path.rglob(LOCK_FILE))  # every runner let its lock go


def test_runs_in_the_results_file_are_not_trained_again_and_prune_as_run_folders_do(tmp_path, subsets, monkeypatch):
    """A grid resumed where its run folders are not (another machine, a fresh clone) skips what the committed
    results file holds as measured with its settings under this torch, and prunes from those records."""
    trained = []
    monkeypatch.setattr(grid, 'train_run', _fake_training(trained, {(0.001, 0): 0.1, (0.002, 0): 0.1}))
    results = tmp_path / 'tiny.jsonl'
    assert run_grid(tmp_path / 'first', ['lipsformer'], [0.001, 0.002], [0, 1], TINY, subsets, CPU) == 4
    collect(tmp_path / 'first', results)
    recorded = read_results(results)
    trained.clear()
    second = tmp_path / 'second'
    assert run_grid(second, ['lipsformer'], [0.001, 0.002, 0.004], [0, 1], TINY, subsets, CPU, stop_after_failures=2,
                    recorded=recorded) == 1
    assert trained == [(0.004, 1)]  # seed 0 was stuck at chance at 0.001 and 0.002 in the file: left out
    marker = json.loads(RunFiles(run_dir(second, 'lipsformer', 0.004, 0)).not_run.read_text())
    assert marker['not_run'] == {'stop_after_failures': 2, 'failed_at': [0.001, 0.002]}
    # Records of another sweep (other settings) or of another torch version say nothing about this grid's runs.
    other_sweep = RunSettings(**{**TINY.__dict__, 'steps': 3})
    assert run_grid(tmp_path / 'third', ['lipsformer'], [0.001], [0], other_sweep, subsets, CPU,
                    recorded=recorded) == 1
    other_torch = Results(recorded.settings, [{**r, 'torch': '2.6.0+cpu'} for r in recorded.records])
    assert run_grid(tmp_path / 'fourth', ['lipsformer'], [0.001], [0], TINY, subsets, CPU, recorded=other_torch) == 1


def test_runs_left_out_are_collected_apart_and_a_measurement_wins(tmp_path, subsets, monkeypatch):
    out, path = tmp_path / 'runs', tmp_path / 'tiny.jsonl'
    monkeypatch.setattr(grid, 'train_run', _fake_training([]))
    run_grid(out, ['lipsformer'], PRUNE_LRS, [0, 1], TINY, subsets, CPU, stop_after_failures=2)
    assert collect(out, path) == (10, 0)
    found = read_results(path)
    assert [(r['lr'], r['seed']) for r in found.not_run] == [(0.008, 0), (0.016, 0)]
    assert found.not_run[0] == dict(arm='lipsformer', lr=0.008, seed=0, warmup_epochs=0, torch=torch.__version__,
                                    not_run={'stop_after_failures': 2, 'failed_at': [0.002, 0.004]})
    assert len(found.records) == 8 and all('not_run' not in r for r in found.records)
    # The runs the pruning left out, run later (the full grid): their measurements replace the not-run lines.
    run_grid(out, ['lipsformer'], [0.008], [0], TINY, subsets, CPU, stop_after_failures=0)
    assert collect(out, path) == (0, 1)
    found = read_results(path)
    assert [(r['lr'], r['seed']) for r in found.not_run] == [(0.016, 0)] and len(found.records) == 9
    # A measurement merged from elsewhere is never replaced by a not-run line.
    measured = compact_record(_fake_result('lipsformer', 0.016, 0, TINY, 0.7), [])
    found.records.append(measured)
    Results(found.settings, found.records, []).write(path)
    assert collect(out, path) == (0, 0)
    found = read_results(path)
    assert not found.not_run and measured in found.records


def _record(arm, lr, seed, final, curve=None, diverged_step=None, torch_version='2.14.1', **extra):
    curve = curve or [[0, 0.1], [250, final or 0.1], *([[500, final]] if final is not None else [])]
    best_step, best = max(curve, key=lambda p: p[1])
    return dict(arm=arm, lr=lr, seed=seed, warmup_epochs=ARMS[arm].warmup_epochs, torch=torch_version,
                final_accuracy=final, best_accuracy=best, best_step=best_step, diverged_step=diverged_step,
                curve=curve, final_train_loss=0.5, steps_to_loss=100 if final and final > 0.5 else None,
                peak_grad_norm=3.0, final_log10_bound=None if final is None else 5.0,
                cpu={'name': 'Test CPU', 'family': '6', 'model': '85'}, threads=1, seconds=100.0, cpu_seconds=90.0,
                **extra)


SETTINGS = {**RunSettings(dataset='toy').as_dict()}


def test_failures_are_classified_from_all_seeds_and_rates():
    diverged = _record('lipsformer', 0.064, 0, None, curve=[[0, 0.1], [50, 0.4]], diverged_step=77)
    assert classify(diverged, 0.8, SETTINGS) == ('diverged', 77)
    # Chance is 10%; a final accuracy below 14.5% is at chance.
    never = _record('lipsformer', 0.032, 0, 0.14, curve=[[0, 0.1], [50, 0.12], [100, 0.1], [500, 0.14]])
    assert classify(never, 0.8, SETTINGS) == ('stuck', None)
    collapsed = _record('lipsformer', 0.032, 1, 0.1, curve=[[0, 0.1], [50, 0.6], [100, 0.7], [150, 0.1], [500, 0.1]])
    assert classify(collapsed, 0.8, SETTINGS) == ('stuck', 150)
    assert classify(_record('lipsformer', 0.016, 0, 0.779), 0.8, SETTINGS) == ('degraded', None)
    assert classify(_record('lipsformer', 0.016, 0, 0.781), 0.8, SETTINGS) == ('trains', None)


def test_the_highest_stable_rate_and_each_seeds_first_failure():
    runs = [_record('layernorm', 0.001, s, 0.8) for s in range(3)]
    runs += [_record('layernorm', 0.002, 0, 0.81), _record('layernorm', 0.002, 1, 0.7), _record('layernorm', 0.002, 2,
                                                                                                0.8)]
    runs += [_record('layernorm', 0.004, s, 0.8) for s in range(2)]
    runs += [_record('layernorm', 0.004, 2, None, diverged_step=9)]
    runs += [_record('layernorm', 0.008, s, 0.1) for s in range(3)]
    cells = {}
    for run in runs:
        cells.setdefault((run['arm'], run['lr']), []).append(run)
    kinds = {id(r): classify(r, 0.8, SETTINGS) for r in runs}
    highest, failures = stable_rates(cells, 'layernorm', kinds)
    assert highest == 0.001
    assert failures == [(0, 0.008, 'stuck', None), (1, 0.002, 'degraded', None), (2, 0.004, 'diverged', 9)]
    # Too slow at the lowest rate (degraded, stuck) is not instability: the range starts where every seed trains.
    slow = [_record('trunc_normal_init', 0.001, 0, 0.75), _record('trunc_normal_init', 0.001, 1, 0.1),
            *[_record('trunc_normal_init', lr, s, 0.8) for lr in (0.002, 0.004) for s in range(2)],
            _record('trunc_normal_init', 0.008, 0, 0.8), _record('trunc_normal_init', 0.008, 1, 0.7)]
    cells = {}
    for run in slow:
        cells.setdefault((run['arm'], run['lr']), []).append(run)
    kinds = {id(r): classify(r, 0.8, SETTINGS) for r in slow}
    assert stable_rates(cells, 'trunc_normal_init', kinds) == (0.004, [(1, 0.008, 'degraded', None)])
    # With no rate where every seed trains, each seed's first failure is its lowest.
    del cells['trunc_normal_init', 0.002], cells['trunc_normal_init', 0.004]
    assert stable_rates(cells, 'trunc_normal_init', kinds) == (None, [(0, 0.001, 'degraded', None),
                                                                      (1, 0.001, 'stuck', None)])


def _not_run(arm, lr, seed, failed_at):
    return dict(arm=arm, lr=lr, seed=seed, warmup_epochs=ARMS[arm].warmup_epochs, torch='2.14.1',
                not_run={'stop_after_failures': 2, 'failed_at': failed_at})


def test_outright_failures_are_those_known_without_the_arms_best():
    assert outright_failure(_record('lipsformer', 0.064, 0, None, diverged_step=77), SETTINGS) == 'diverged'
    assert outright_failure(_record('lipsformer', 0.064, 0, 0.1449), SETTINGS) == 'stuck'
    assert outright_failure(_record('lipsformer', 0.064, 0, 0.146), SETTINGS) is None  # degraded at most


def test_runs_left_out_count_as_failures_and_are_reported_apart(tmp_path):
    # layernorm seed 0: stuck at 0.002, diverged at 0.004, left out at 0.008 where seeds 1 and 2 train.
    records = [_record('layernorm', lr, seed, 0.8) for lr in (0.001, 0.002, 0.004, 0.008) for seed in (1, 2)]
    records += [_record('layernorm', 0.001, 0, 0.8), _record('layernorm', 0.002, 0, 0.1),
                _record('layernorm', 0.004, 0, None, diverged_step=12)]
    # alpha_fixed_1: every seed diverges at 0.002 and 0.004; none runs at 0.008.
    records += [_record('alpha_fixed_1', 0.001, seed, 0.8) for seed in range(3)]
    records += [_record('alpha_fixed_1', lr, seed, None, diverged_step=5) for lr in (0.002, 0.004) for seed in range(3)]
    left_out = [_not_run('layernorm', 0.008, 0, [0.002, 0.004])]
    left_out += [_not_run('alpha_fixed_1', 0.008, seed, [0.002, 0.004]) for seed in range(3)]
    cells, not_run = {}, {}
    for run in records:
        cells.setdefault((run['arm'], run['lr']), []).append(run)
    for run in left_out:
        not_run.setdefault((run['arm'], run['lr']), []).append(run)
    kinds = {id(r): classify(r, 0.8, SETTINGS) for r in records}
    highest, failures = stable_rates(cells, 'layernorm', kinds, not_run)
    assert highest == 0.001  # 0.008 has a seed left out: not stable, though every seed that ran trains
    assert failures == [(0, 0.002, 'stuck', None)]  # the first failure is a measured one
    assert stable_rates(cells, 'layernorm', kinds)[0] == 0.001  # 0.008 trains, but 0.002 and 0.004 below it fail
    results, docs = tmp_path / 'toy.jsonl', tmp_path / 'docs'
    _results_file(results, records + left_out)
    write_stability_report(results, docs)
    text = (docs / 'stability.md').read_text()
    assert '| layernorm | 80.0 | 10.0 [1 seed]; 1 stuck' not in text
    assert '| 80.0 ± 0.0 [2 seeds]; 1 not run |' in text  # layernorm at 0.008
    assert text.count('| not run: failed at two lower rates in a row |') == 1  # alpha_fixed_1 at 0.008
    assert '4 runs not run (`--stop-after-failures 2`)' in text
    assert '| layernorm | none | 0.001: 80.0 ± 0.0 | 0.001 | 0: 0.002, stuck at chance' in text
    assert (docs / 'stability_toy.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'


def _results_file(path, records, settings=SETTINGS):
    path.write_text(''.join(json.dumps(r) + '\n' for r in [{'settings': settings}, *records]))


def test_the_report_is_rebuilt_from_the_results_file_alone(tmp_path):
    records = []
    for lr in (0.001, 0.002, 0.004):
        for seed in range(3):
            records.append(_record('lipsformer', lr, seed, 0.8 + seed / 1000))
            records.append(_record('lipsformer_warmup', lr, seed, 0.79))
            post = 0.1 if lr == 0.004 else 0.78
            records.append(_record('post_norm_transformer', lr, seed, post))
            records.append(_record('post_norm_transformer_warmup', lr, seed, 0.78))
            if lr == 0.004:
                records.append(_record('alpha_fixed_1', lr, seed, None, diverged_step=100 + seed))
    records[-3]['final_train_loss'] = 1.5e5  # post_norm_transformer 0.004 seed 2: blown up, yet finite
    # The claim cells again under the lowest torch: side by side in their own table.
    records += [_record('post_norm_transformer', 0.004, 0, 0.77, torch_version='2.6.0'),
                _record('lipsformer', 0.004, 0, 0.8, torch_version='2.6.0')]
    results, docs = tmp_path / 'toy.jsonl', tmp_path / 'docs'
    _results_file(results, records)
    docs.mkdir()
    start, end = markers('toy')
    (docs / 'stability.md').write_text(f'# Title\n\nintro kept\n\n{start}\nold table\n{end}\n\nanalysis kept\n')
    write_stability_report(results, docs)
    text = (docs / 'stability.md').read_text()
    assert 'intro kept' in text and 'analysis kept' in text and 'old table' not in text
    assert '| post_norm_transformer | 0.002 | >= 0.004 (the highest rate run) |' in text  # what warmup buys
    assert '| lipsformer | >= 0.004 (the highest rate run) | >= 0.004 (the highest rate run) |' in text
    assert '| alpha_fixed_1 | 0.004 | 3 | - |' in text  # every seed diverged: no final accuracy
    assert '- [1 seed]; 1 diverged (steps 100)' not in text and '3 diverged (steps 100, 101, 102)' in text
    assert ('| post_norm_transformer | none | 0.001: 78.0 ± 0.0 | 0.002 | 0: 0.004, stuck at chance (never above '
            'it); ') in text
    assert '2: 0.004, stuck at chance (never above it), training loss 1.5e+05 |' in text
    assert '| post_norm_transformer | 0.004 | 0 | 10.0, stuck at chance (never above it) | 77.0 |' in text
    assert 'Test CPU (family 6, model 85), 1 thread(s)' in text
    assert (docs / 'stability_toy.png').read_bytes()[:8] == b'\x89PNG\r\n\x1a\n'
    write_stability_report(results, docs)  # regenerating keeps the page's shape
    assert (docs / 'stability.md').read_text().count(start) == 1


def test_the_report_adds_a_section_for_a_new_data_set(tmp_path):
    results = tmp_path / 'other.jsonl'
    _results_file(results, [_record('lipsformer', 0.001, 0, 0.5)], {**SETTINGS, 'dataset': 'other'})
    (tmp_path / 'stability.md').write_text('# Title\n\nkept\n')
    write_stability_report(results, tmp_path)
    text = (tmp_path / 'stability.md').read_text()
    assert text.startswith('# Title\n\nkept\n\n## The sweep on other\n') and markers('other')[0] in text
    # only one rate run: a lower bound; the warmup arm has not run yet
    assert '| lipsformer | >= 0.001 (the highest rate run) | - (no runs yet) |' in text


def test_steps_to_loss_uses_the_smoothed_loss():
    records = [{'step': i + 1, 'loss': loss} for i, loss in enumerate([1.0] * 5 + [0.1] * 30)]
    # Steps 4-7 average 0.55, steps 5-8 0.325.
    assert steps_to_loss(records, threshold=0.5, window=4) == 8
    assert steps_to_loss(records[:5], threshold=0.5, window=4) is None


def test_the_command_line_runs_collects_and_reports(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    experiment_command.main(['--out', 'runs', '--arms', 'pre_norm_transformer', '--lrs', '1e-3', '--seeds', '0',
                             '--synthetic', *TINY_ARGS])
    assert RunFiles(run_dir(tmp_path / 'runs', 'pre_norm_transformer', 1e-3, 0)).done()
    experiment_command.main(['--out', 'runs', '--synthetic', '--collect'])
    assert len(read_results(tmp_path / 'results/stability/fashion_mnist_synthetic.jsonl').records) == 1
    experiment_command.main(['--synthetic', '--report', 'docs'])
    assert '| pre_norm_transformer | 0.001 | 1 |' in (tmp_path / 'docs' / 'stability.md').read_text()
    # From the results file alone (other run folders): nothing to train, unless asked to train it again.
    again = ['--arms', 'pre_norm_transformer', '--lrs', '1e-3', '--seeds', '0', '--synthetic', *TINY_ARGS]
    experiment_command.main(['--out', 'elsewhere', *again])
    assert not (tmp_path / 'elsewhere').exists()
    experiment_command.main(['--out', 'elsewhere', '--retrain-recorded', *again])
    assert RunFiles(run_dir(tmp_path / 'elsewhere', 'pre_norm_transformer', 1e-3, 0)).done()
    with pytest.raises(SystemExit):
        experiment_command.main(['--out', str(tmp_path), '--arms', 'resnet'])
    assert experiment_command.parse_args(['--out', 'runs']).stop_after_failures == 2  # pruning is on by default
    with pytest.raises(SystemExit):
        experiment_command.parse_args(['--out', 'runs', '--stop-after-failures', '-1'])


def _image_folder(root, classes, sizes, mode):
    """``root/train`` and ``root/val`` with one folder per class; each class a colour (or grey level) of its own."""
    for split, count in (('train', 4), ('val', 2)):
        for c, name in enumerate(classes):
            folder = root / split / name
            folder.mkdir(parents=True)
            for i in range(count):
                size = sizes[i % len(sizes)]
                value = 40 + 80 * c
                colour = value if mode == 'L' else (value, 255 - value, (7 * value) % 256)
                Image.new(mode, size, colour).save(folder / f'{i}.png')


def test_an_image_folder_sets_channels_classes_and_size(tmp_path):
    _image_folder(tmp_path / 'grey', ['a', 'b'], [(20, 20)], 'L')
    grey = load_image_folder(str(tmp_path / 'grey'), 32, 8, 4)
    assert grey.train_images.shape == (8, 1, 32, 32) and grey.num_classes == 2 and grey.test_images.shape[0] == 4
    torch.testing.assert_close(grey.train_images.mean(), torch.tensor(0.0), atol=1e-5, rtol=0)
    with pytest.raises(ValueError, match='--train-size 10 needs 5 images of each class'):
        load_image_folder(str(tmp_path / 'grey'), 32, 10, 4)


def test_the_sweep_runs_on_an_image_folder(tmp_path, monkeypatch):
    # Three classes of colour images of several sizes and aspect ratios: resized to 32x32, three channels.
    _image_folder(tmp_path / 'shapes', ['circle', 'square', 'star'], [(40, 24), (16, 16), (33, 70)], 'RGB')
    monkeypatch.chdir(tmp_path)
    tiny = [*TINY_ARGS[:4], '--train-size', '12', '--test-size', '6', *TINY_ARGS[8:]]
    experiment_command.main(['--out', 'runs', '--data-dir', 'shapes', '--arms', 'lipsformer', '--lrs', '1e-3',
                             '--seeds', '0', *tiny])
    result = json.loads(RunFiles(run_dir(tmp_path / 'runs', 'lipsformer', 1e-3, 0)).result.read_text())
    assert result['settings']['dataset'] == 'shapes'
    assert (result['settings']['shape']['in_chans'], result['settings']['shape']['num_classes']) == (3, 3)
    assert result['steps_per_epoch'] == 1 and len(result['test_curve']) == 3
    experiment_command.main(['--out', 'runs', '--data-dir', 'shapes', '--collect'])
    experiment_command.main(['--data-dir', 'shapes', '--report', 'docs'])
    text = (tmp_path / 'docs' / 'stability.md').read_text()
    assert '## The sweep on shapes' in text and '3 channel(s), 3 classes' in text
