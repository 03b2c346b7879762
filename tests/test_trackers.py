"""Experiment trackers through Accelerate: one run logged to TensorBoard, wandb (offline) and MLflow (a file store),
each read back with its own reader and checked against metrics.jsonl and the recipe."""
import glob
import json
import math
import os
import struct

import pytest
from image_data import make_image_folder
from process_support import single_thread
from training_support import tiny_overrides

from lipsformer.training import ConfigError, load_config, train
from lipsformer.training import trackers as trackers_module
from lipsformer.training.trackers import chosen_trackers

UPDATES_PER_EPOCH = 6  # 48 training images in batches of 8
STEP_KEYS = ('train/step_loss', 'train/lr', 'train/grad_norm')


def _train(data_dir: str, run_dir: str, **overrides) -> list[dict]:
    settings = {'train.log_interval': 1, 'checkpoint.export': False, **overrides}
    with single_thread():
        train(load_config(None, tiny_overrides(data_dir, **settings)), run_dir)
    return [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]


def _tensorboard_scalars(folder: str) -> dict[str, dict[int, float]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    events = EventAccumulator(folder)
    events.Reload()
    return {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()['scalars']}


def _wandb_history(run_dir: str) -> dict[str, dict[int, float]]:
    """The history rows of the offline run (of each of its starts, for a resumed run)."""
    history: dict[str, dict[int, float]] = {}
    for path in sorted(glob.glob(os.path.join(run_dir, 'wandb', 'offline-run-*', 'run-*.wandb'))):
        for key, values in _wandb_log_history(path).items():
            history.setdefault(key, {}).update(values)
    return history


def _wandb_log_history(path: str) -> dict[str, dict[int, float]]:
    """The history rows of one offline run's transaction log (a LevelDB-style log of protobuf records: a 7-byte file
    header, 32 KiB blocks, each chunk with a 7-byte header: checksum, length, type)."""
    from wandb.proto import wandb_internal_pb2
    data = open(path, 'rb').read()
    assert data[:4] == b':W&B'
    history: dict[str, dict[int, float]] = {}
    position, pending = 7, b''
    while position + 7 <= len(data):
        room = 32768 - position % 32768
        _, length, kind = struct.unpack('<IHB', data[position:position + 7]) if room >= 7 else (0, 0, 0)
        if kind == 0:  # the zero padding at a block's end
            position += room
            continue
        pending += data[position + 7:position + 7 + length]
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            pending = b''
            if record.WhichOneof('record_type') == 'history':
                row = {item.key or '/'.join(item.nested_key): json.loads(item.value_json)
                       for item in record.history.item}
                for key, value in row.items():
                    history.setdefault(key, {})[row['_step']] = value
    return history


def _mlflow_metrics(run_dir: str) -> dict[str, dict[int, float]]:
    from mlflow.tracking import MlflowClient
    client = MlflowClient(tracking_uri='file://' + os.path.join(run_dir, 'mlruns'))
    (experiment,) = [e for e in client.search_experiments() if e.name == 'lipsformer']
    (run,) = client.search_runs([experiment.experiment_id])
    assert run.info.run_name == os.path.basename(run_dir) and run.data.params['optimizer.lr'] == '0.002'
    return {key: {m.step: m.value for m in client.get_metric_history(run.info.run_id, key)}
            for key in run.data.metrics}


@pytest.fixture
def offline_trackers(monkeypatch):
    for package in ('tensorboard', 'wandb', 'mlflow'):
        pytest.importorskip(package, reason=f'pip install "lipsformer[{package}]" for its tracker')
    monkeypatch.setenv('WANDB_MODE', 'offline')
    monkeypatch.setenv('WANDB_SILENT', 'true')
    for variable in ('WANDB_DIR', 'MLFLOW_TRACKING_URI', 'MLFLOW_EXPERIMENT_NAME', 'MLFLOW_RUN_ID'):
        monkeypatch.delenv(variable, raising=False)


@pytest.mark.usefixtures('offline_trackers')
def test_one_run_logged_to_three_trackers_offline(tmp_path):
    data_dir = make_image_folder(str(tmp_path / 'data'))
    run_dir = str(tmp_path / 'three')
    lines = _train(data_dir, run_dir, **{'log.trackers': '[tensorboard, wandb, mlflow]'})
    logged = {'tensorboard': _tensorboard_scalars(os.path.join(run_dir, 'tensorboard', 'lipsformer')),
              'wandb': _wandb_history(run_dir), 'mlflow': _mlflow_metrics(run_dir)}
    steps = list(range(1, 2 * UPDATES_PER_EPOCH + 1))
    for name, series in logged.items():
        for key in STEP_KEYS:
            assert sorted(series[key]) == steps, (name, key)  # every update, as log_interval=1
        assert series['train/lr'][1] == pytest.approx(2e-3)  # no warmup: the first update uses the peak lr
        lrs = [series['train/lr'][s] for s in steps]
        assert all(a > b for a, b in zip(lrs, lrs[1:])) and lrs[-1] > 1e-5  # cosine, per update, above min_lr
        assert all(math.isfinite(v) and v > 0 for v in series['train/grad_norm'].values())
        for line in lines:  # the epoch metrics, at the epoch's last update
            end = line['epoch'] * UPDATES_PER_EPOCH
            for key in ('train_loss', 'val_top1', 'ema_val_top1', 'alpha/stage0/mean'):
                assert series[key][end] == pytest.approx(line[key], rel=1e-6), (name, key)
            # The epoch's train loss is the mean of its updates' losses (equal batches, all finite).
            epoch_steps = range(end - UPDATES_PER_EPOCH + 1, end + 1)
            mean = sum(series['train/step_loss'][s] for s in epoch_steps) / UPDATES_PER_EPOCH
            assert mean == pytest.approx(line['train_loss'], rel=1e-5), name
    for key in STEP_KEYS:  # the three hold the same numbers
        assert logged['wandb'][key] == pytest.approx(logged['tensorboard'][key], rel=1e-6)
        assert logged['mlflow'][key] == pytest.approx(logged['tensorboard'][key], rel=1e-6)


@pytest.mark.usefixtures('offline_trackers')
def test_a_resumed_run_continues_its_wandb_and_mlflow_runs(tmp_path, caplog):
    data_dir = make_image_folder(str(tmp_path / 'data'))
    run_dir = str(tmp_path / 'resumed')
    trackers = {'log.trackers': '[wandb, mlflow]', 'train.log_interval': 3}
    _train(data_dir, run_dir, **trackers, **{'train.epochs': 1})
    ids = json.load(open(os.path.join(run_dir, 'trackers.json')))
    with single_thread():  # the same run, two epochs long now: resumed from the first epoch's checkpoint
        longer = tiny_overrides(data_dir, **trackers, **{'train.epochs': 2, 'checkpoint.export': False})
        train(load_config(None, longer), run_dir, resume='auto')
    assert json.load(open(os.path.join(run_dir, 'trackers.json'))) == ids
    assert 'changed since this run started: train.epochs 1 -> 2' in caplog.text  # MLflow keeps a param's first value
    starts = glob.glob(os.path.join(run_dir, 'wandb', 'offline-run-*'))
    assert len(starts) == 2 and all(path.endswith('-' + ids['wandb']['id']) for path in starts)
    for history in (_wandb_history(run_dir), _mlflow_metrics(run_dir)):  # _mlflow_metrics: exactly one run
        assert sorted(history['train/step_loss']) == [3, 6, 9, 12] and sorted(history['val_top1']) == [6, 12]


def test_grad_norm_is_measured_before_clipping_and_only_every_log_interval(tmp_path):
    pytest.importorskip('tensorboard')
    data_dir = make_image_folder(str(tmp_path / 'data'))
    run_dir = str(tmp_path / 'clipped')
    _train(data_dir, run_dir, **{'log.trackers': '[tensorboard]', 'train.log_interval': 4, 'train.epochs': 1,
                                 'optimizer.clip_grad': 1e-3})
    scalars = _tensorboard_scalars(os.path.join(run_dir, 'tensorboard', 'lipsformer'))
    assert sorted(scalars['train/grad_norm']) == [4]  # 6 updates, every 4th reported
    assert scalars['train/grad_norm'][4] > 1e-2  # far above the threshold it was clipped to


def test_choosing_trackers(monkeypatch):
    installed = {'tensorboard': True, 'wandb': False, 'mlflow': True}
    monkeypatch.setattr(trackers_module, '_AVAILABLE', {k: (lambda v=v: v) for k, v in installed.items()})
    assert chosen_trackers(load_config(None, ['log.trackers=[all]'])) == ['tensorboard', 'mlflow']
    assert chosen_trackers(load_config(None, [])) == ['tensorboard']  # null: TensorBoard when installed
    assert chosen_trackers(load_config(None, ['log.trackers=[]'])) == []
    with pytest.raises(ConfigError, match=r'log.trackers: wandb is not installed; pip install "lipsformer\[wandb\]"'):
        chosen_trackers(load_config(None, ['log.trackers=[mlflow, wandb]']))
    with pytest.raises(ConfigError, match='log.trackers: got .*comet.*allowed: null or a list of tensorboard'):
        load_config(None, ['log.trackers=[comet]'])


def test_run_folders_written_with_log_tensorboard_still_load():
    """config.yaml of runs from before log.trackers (validate.py and model cards read it)."""
    assert load_config(None, ['log.tensorboard=true']).log.trackers == ['tensorboard']
    assert load_config(None, ['log.tensorboard=false']).log.trackers == []
    assert load_config(None, ['log.tensorboard=null']).log.trackers is None
    with pytest.raises(ConfigError, match='log.tensorboard is replaced by log.trackers'):
        load_config(None, ['log.tensorboard=true', 'log.trackers=[wandb]'])
