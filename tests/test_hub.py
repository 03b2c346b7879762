"""The Hub and timm folders: model cards, the upload (stopped at the network), and hf-hub: / local-dir: names in
train.py, validate.py, the Lipschitz analysis and the benchmark. No test reaches the network: the upload's final
calls and the Hub downloads are replaced by fakes that record what would be sent or serve a local folder."""
import json
import os
import re
import shutil

import huggingface_hub
import pytest
import safetensors.torch
import timm
import timm.models._hub
import torch
from accelerate.state import AcceleratorState
from huggingface_hub.utils import LocalEntryNotFoundError
from image_data import make_image_folder
from storage_faults import read_only
from training_support import tiny_overrides

from lipsformer.evaluation.checkpoints import create_eval_model
from lipsformer.evaluation.validate_command import main as validate_main
from lipsformer.hub import CardError, ModelSourceError, check_model_source, create_model, write_card
from lipsformer.hub.__main__ import main as hub_main
from lipsformer.hub.convert import convert
from lipsformer.instruments.benchmark import BenchmarkConfig, _build, parse_model_specs
from lipsformer.lipschitz.analysis import analyze
from lipsformer.lipschitz.report_command import main as lipschitz_main
from lipsformer.training import ConfigError, load_config, train
from lipsformer.training.data import resolve_input_spec
from lipsformer.training.session import create_run_model
from lipsformer.weights.model_names import expand_model_names
from lipsformer.weights.weight_files import load_file

pytestmark = pytest.mark.usefixtures('one_thread')


@pytest.fixture(scope='module')
def run_dir(data_dir, tmp_path_factory):
    """A finished two-epoch run with EMA, plots and exports."""
    folder = str(tmp_path_factory.mktemp('run') / 'run')
    train(load_config(None, tiny_overrides(data_dir, **{'log.plots': True})), folder)
    return folder


def _copy(run_dir: str, tmp_path) -> str:
    target = str(tmp_path / 'run')
    shutil.copytree(run_dir, target)
    return target


def _inputs() -> torch.Tensor:
    return torch.randn(2, 1, 32, 32, generator=torch.Generator().manual_seed(3))


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model.eval()(_inputs())


def _export_model(export: str) -> torch.nn.Module:
    """The exported network built by hand, as transformers' TimmWrapper builds it: registered name, the class count
    at config.json's root, the saved arguments, the export's weights."""
    config = json.load(open(os.path.join(export, 'config.json')))
    model = timm.create_model(config['architecture'], num_classes=config['num_classes'], **config['model_args'])
    model.load_state_dict(load_file(os.path.join(export, 'model.safetensors')))
    return model


def _header(card: str) -> dict[str, object]:
    header = card.split('---\n')[1]
    return {k: v for k, v in re.findall(r'^(\w+): (.+)$', header, re.M)}


def test_card_describes_the_run(run_dir, data_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    assert hub_main(['card', run]) == 0
    export = os.path.join(run, 'export', 'best')
    card = open(os.path.join(export, 'README.md')).read()
    assert _header(card) == {'library_name': 'timm', 'license': 'apache-2.0', 'pipeline_tag': 'image-classification'}
    summary = json.load(open(os.path.join(run, 'summary.json')))
    epochs = [json.loads(line) for line in open(os.path.join(run, 'metrics.jsonl'))]
    (best,) = [line for line in epochs if line['epoch'] == summary['best_epoch'] and 'val_top1' in line]
    # The Hub's reading of the metadata: tags, and a model-index with the exported epoch's scores; an image folder
    # has no Hub dataset id, so no datasets entry.
    data = huggingface_hub.ModelCard(card).data
    assert 'lipsformer' in data.tags and data.metrics == ['accuracy'] and data.datasets is None
    assert {(r.task_type, r.dataset_type, r.dataset_name, r.dataset_split, r.metric_type, r.metric_name,
             r.metric_value) for r in data.eval_results} == {
        ('image-classification', 'imagefolder', os.path.basename(data_dir), 'validation', 'accuracy',
         'Top-1 accuracy', round(best['val_top1'], 3)),
        ('image-classification', 'imagefolder', os.path.basename(data_dir), 'validation', 'accuracy',
         'Top-5 accuracy', round(best['val_top5'], 3))}
    assert f'| raw | `model.safetensors` | {best["val_top1"]:.2f} | {best["val_top5"]:.2f} |' in card
    assert f'| EMA | `model_ema.safetensors` | {best["ema_val_top1"]:.2f} | {best["ema_val_top5"]:.2f} |' in card
    assert f'after 2 epochs. These weights are from epoch {best["epoch"]} (the best epoch of the run)' in card
    assert f'Best {summary["best_metric"]}: {summary["best_value"]:.2f} at epoch {summary["best_epoch"]}' in card
    params = sum(p.numel() for p in _export_model(export).parameters())
    assert f'parameters: {params / 1e6:.2f}M' in card
    assert '| optimizer.lr | 0.002 |' in card and '| scheduler.warmup_epochs | 0.0 |' in card
    assert 'Theorem 2 product bound' in card and 'stage0' in card  # bounds of the weights, alphas of the run
    for name in ('loss.png', 'accuracy.png', 'alpha.png'):  # relative links to copies inside the export
        assert f'](plots/{name})' in card
        assert open(os.path.join(export, 'plots', name), 'rb').read() == \
            open(os.path.join(run, 'plots', name), 'rb').read()
    assert "timm.create_model('hf-hub:USER/REPO', pretrained=True)" in card and 'local-dir:' in card
    assert '@inproceedings{qi2023lipsformer' in card
    assert hub_main(['card', run, '--which', 'last', '--repo-id', 'me/tiny', '--no-lipschitz']) == 0
    last = open(os.path.join(run, 'export', 'last', 'README.md')).read()
    assert "'hf-hub:me/tiny'" in last and 'Theorem 2' not in last


def test_card_of_a_converted_folder_and_bad_targets(run_dir, tmp_path, capsys):
    folder = str(tmp_path / 'converted')
    shutil.copytree(os.path.join(run_dir, 'export', 'best'), folder)
    path = write_card(folder, lipschitz=False)
    card = open(path).read()
    assert 'No training run beside this folder' in card and 'datasets:' not in card
    assert hub_main(['card', str(tmp_path / 'nothing')]) == 2
    assert 'neither a training run' in capsys.readouterr().err
    with pytest.raises(CardError):
        write_card(str(tmp_path))


def _damage(weights: str, how: str) -> None:
    """Cut ``weights`` in half, or give its classifier a shape the architecture does not have."""
    if how == 'truncated':
        with open(weights, 'r+b') as f:
            f.truncate(os.path.getsize(weights) // 2)
    else:
        tensors = safetensors.torch.load_file(weights)
        tensors['head.fc.weight'] = torch.zeros(3, 3)
        safetensors.torch.save_file(tensors, weights)


@pytest.mark.parametrize('file', ['model.safetensors', 'model_ema.safetensors'])
@pytest.mark.parametrize('how', ['truncated', 'mis-shaped'])
@pytest.mark.parametrize('bounds', [[], ['--no-lipschitz']], ids=['bounds', 'no-lipschitz'])
def test_no_card_for_weights_that_cannot_be_read(run_dir, tmp_path, capsys, file, how, bounds):
    run = _copy(run_dir, tmp_path)
    export = os.path.join(run, 'export', 'best')
    _damage(os.path.join(export, file), how)
    assert hub_main(['card', run, *bounds]) == 2
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'Traceback' not in err
    assert err.startswith('python -m lipsformer.hub: error: the export\'s weights cannot be read, so no card was '
                          'written: ') and os.path.join(export, file) in err
    assert ('truncated' if how == 'truncated' else 'shape mismatch: head.fc.weight') in err
    assert not os.path.exists(os.path.join(export, 'README.md'))


def test_a_card_into_a_read_only_export_is_one_line_and_status_4(run_dir, tmp_path, capsys):
    run = _copy(run_dir, tmp_path)
    export = os.path.join(run, 'export', 'best')
    with read_only(export):
        assert hub_main(['card', run, '--no-lipschitz']) == 4
    err = capsys.readouterr().err
    assert err.count('\n') == 1 and 'Traceback' not in err
    assert re.fullmatch(rf'python -m lipsformer\.hub: error: {re.escape(export)}/(README\.md|plots/\w+\.png) could '
                        r'not be written: (Read-only file system|Permission denied); fix the permissions, or copy the '
                        r'export to another folder and write its card there\n', err), err
    assert not os.path.exists(os.path.join(export, 'README.md'))


class _FakeHub:
    """Stands in for the three HfApi calls that reach the network and records what they were given: the token
    check, the repository and the commit (whose files it reads as the Hub would, or fails as a dropped upload)."""

    def __init__(self, monkeypatch, fail_commit: bool = False):
        self.calls = []
        fake = self
        monkeypatch.setenv('HF_TOKEN', 'hf_fake')

        def whoami(api, token=None, **kwargs):
            fake.calls.append(('whoami', dict(token=token)))
            return {'name': 'me'}

        def create_repo(api, repo_id, private=False, exist_ok=False, **kwargs):
            fake.calls.append(('create_repo', dict(repo_id=repo_id, private=private, exist_ok=exist_ok,
                                                   library=api.library_name)))
            return huggingface_hub.RepoUrl(f'https://huggingface.co/{repo_id}')

        def create_commit(api, repo_id, operations, commit_message=None, revision=None, **kwargs):
            sent = {}
            for operation in operations:
                source = operation.path_or_fileobj
                sent[operation.path_in_repo] = source.getvalue() if hasattr(source, 'getvalue') else \
                    open(source, 'rb').read()
            fake.calls.append(('create_commit', dict(repo_id=repo_id, files=sorted(sent), revision=revision,
                                                     commit_message=commit_message)))
            fake.sent = sent
            fake.card = sent['README.md'].decode()
            if fail_commit:
                raise ConnectionResetError(104, 'Connection reset by peer')
            return None

        monkeypatch.setattr(huggingface_hub.HfApi, 'whoami', whoami)
        monkeypatch.setattr(huggingface_hub.HfApi, 'create_repo', create_repo)
        monkeypatch.setattr(huggingface_hub.HfApi, 'create_commit', create_commit)


def _folder_state(folder: str) -> dict[str, bytes]:
    return {os.path.relpath(os.path.join(root, name), folder): open(os.path.join(root, name), 'rb').read()
            for root, _, names in os.walk(folder) for name in names}


def test_push_sends_the_export_with_its_card(run_dir, tmp_path, monkeypatch, capsys):
    run = _copy(run_dir, tmp_path)
    hub = _FakeHub(monkeypatch)
    assert hub_main(['push', run, 'me/lipsformer-tiny', '--private', '--no-lipschitz']) == 0
    (check, checked), (create, created), (commit, committed) = hub.calls
    assert check == 'whoami' and checked == dict(token='hf_fake')
    assert create == 'create_repo' and created == dict(repo_id='me/lipsformer-tiny', private=True, exist_ok=True,
                                                       library='timm')
    assert commit == 'create_commit' and committed['repo_id'] == 'me/lipsformer-tiny'
    assert committed['files'] == ['README.md', 'config.json', 'model.safetensors', 'model_ema.safetensors',
                                  'plots/accuracy.png', 'plots/alpha.png', 'plots/loss.png']
    assert "timm.create_model('hf-hub:me/lipsformer-tiny', pretrained=True)" in hub.card
    # 1 channel: the pipeline makes paths and PIL images RGB, so the card gives it a one-channel array
    assert "print(classifier(np.asarray(Image.open('image.jpg').convert('L'))[..., None]))" in hub.card
    assert "print(classifier('image.jpg'))" not in hub.card
    assert "AutoModelForImageClassification.from_pretrained('me/lipsformer-tiny')" in hub.card
    assert committed['commit_message'] == 'Add lipsformer_swin_tiny weights'
    # Written into the export after the upload: the same card, and the plots it shows.
    export = os.path.join(run, 'export', 'best')
    assert {name: data for name, data in _folder_state(export).items() if name in hub.sent} == hub.sent
    # An export pushed alone, its edited card kept; a public repository unless --private.
    export = os.path.join(run, 'export', 'last')
    open(os.path.join(export, 'README.md'), 'w').write('my own card\n')
    hub.calls.clear()
    assert hub_main(['push', export, 'me/other', '--keep-card']) == 0
    assert hub.calls[1][1]['private'] is False and hub.card == 'my own card\n'


def test_push_refuses_an_incomplete_export(run_dir, tmp_path, monkeypatch, capsys):
    run = _copy(run_dir, tmp_path)
    os.remove(os.path.join(run, 'export', 'best', 'model.safetensors'))
    hub = _FakeHub(monkeypatch)
    assert hub_main(['push', os.path.join(run, 'export', 'best'), 'me/x', '--no-lipschitz']) == 2
    assert 'lacks model.safetensors' in capsys.readouterr().err and hub.calls == []


def test_a_failed_upload_leaves_the_export_as_it_was(run_dir, tmp_path, monkeypatch, capsys):
    run = _copy(run_dir, tmp_path)
    export = os.path.join(run, 'export', 'best')
    before = _folder_state(export)
    hub = _FakeHub(monkeypatch, fail_commit=True)
    assert hub_main(['push', run, 'me/x', '--no-lipschitz']) == 2
    assert 'error: the upload to me/x lost the connection to the Hugging Face Hub ([Errno 104] Connection reset by ' \
           'peer); the export is unchanged' in capsys.readouterr().err
    assert "'hf-hub:me/x'" in hub.card  # what was on its way up
    assert _folder_state(export) == before


def test_fine_tune_from_a_local_dir_export_with_another_class_count(run_dir, tmp_path, caplog):
    export = os.path.join(run_dir, 'export', 'best')
    name = f'local-dir:{export}'
    three_classes = make_image_folder(str(tmp_path / 'images'), num_classes=3)
    overrides = tiny_overrides(three_classes, **{'train.epochs': 1, 'model.pretrained': True,
                                                 'checkpoint.export': False})
    config = load_config(None, [o for o in overrides if not o.startswith(('model.name=', 'model.kwargs='))]
                         + [f'model.name={name}'])
    caplog.set_level('INFO', logger='lipsformer.training.session')
    model, _ = create_run_model(config, 3, resolve_input_spec(config))
    assert 'the pretrained weights have a 4-class classifier and the model 3 classes: head.fc starts from its ' \
           'initialisation' in caplog.text
    exported = _export_model(export).state_dict()
    for key, value in model.state_dict().items():
        if not key.startswith('head.fc.'):
            assert torch.equal(value, exported[key]), key
    assert model.head.fc.weight.shape == (3, 128)
    summary = train(config, str(tmp_path / 'fine-tuned'))  # the whole run works from that name
    assert summary['status'] == 'finished'


def test_bad_local_dir_names_fail_before_anything_is_built(run_dir, data_dir, tmp_path):
    with pytest.raises(ModelSourceError, match='holds no config.json'):
        check_model_source(f'local-dir:{tmp_path}')
    with pytest.raises(ModelSourceError, match='does not exist'):
        check_model_source(f'local-dir:{tmp_path / "missing"}')
    (tmp_path / 'config.json').write_text(json.dumps({'architecture': 'lipsformer_swin_tiny'}))
    with pytest.raises(ModelSourceError, match='no weights file'):
        check_model_source(f'local-dir:{tmp_path}')
    config = load_config(None, tiny_overrides(data_dir, **{'model.name': f'local-dir:{tmp_path / "missing"}'}))
    with pytest.raises(ConfigError, match='model.name: local-dir:'):
        train(config, str(tmp_path / 'run'))


def test_validate_scores_a_local_dir_export_as_training_did(run_dir, data_dir, tmp_path):
    export = os.path.join(run_dir, 'export', 'best')
    results = tmp_path / 'results.json'
    AcceleratorState._reset_state(reset_partial_state=True)  # as a new process has it
    assert validate_main(['--model', f'local-dir:{export}', '--data-layout', 'imagefolder', '--data-dir',
                          os.path.join(data_dir, 'validation'), '--workers', '0', '--results-file', str(results)]) == 0
    (result,) = json.loads(results.read_text())['results']
    summary = json.load(open(os.path.join(run_dir, 'summary.json')))
    epochs = [json.loads(line) for line in open(os.path.join(run_dir, 'metrics.jsonl'))]
    (best,) = [line for line in epochs if line.get('epoch') == summary['best_epoch'] and 'val_top1' in line]
    assert result['top1'] == pytest.approx(best['val_top1']) and result['count'] == best['val_samples']


def test_results_are_bound_to_the_weights_by_content(run_dir, data_dir, tmp_path, capsys):
    """A results file made on a run's export joins the card of a byte-identical copy of the run folder (the
    weights' SHA-256, not their path, binds them); it is refused for other weights, naming both."""
    run = _copy(run_dir, tmp_path)
    results = tmp_path / 'results.json'
    AcceleratorState._reset_state(reset_partial_state=True)  # as a new process has it
    assert validate_main(['--checkpoint', run, '--data-layout', 'imagefolder', '--data-dir',
                          os.path.join(data_dir, 'validation'), '--workers', '0', '--results-file', str(results)]) == 0
    record = json.loads(results.read_text())
    (result,) = record['results']
    weights = os.path.join(run, 'export', 'best', 'model.safetensors')
    assert record['checkpoint'] == weights
    copy = str(tmp_path / 'copy')
    shutil.copytree(run, copy)
    assert hub_main(['card', copy, '--results', str(results), '--no-lipschitz']) == 0
    card = open(os.path.join(copy, 'export', 'best', 'README.md')).read()
    assert f'validate.py on {result["count"]} images of {result["path"]}' in card
    shutil.rmtree(run)  # the scored folder moved away: the copy still makes its card
    assert hub_main(['card', copy, '--results', str(results), '--no-lipschitz']) == 0
    # A results file of an older validate.py (no hash) binds by path: it joins the card of the folder it scored, and
    # for any other the refusal says that only the path could be compared.
    older = tmp_path / 'older.json'
    unhashed = {key: value for key, value in record.items() if key != 'checkpoint_sha256'}
    older.write_text(json.dumps(unhashed))
    capsys.readouterr()
    assert hub_main(['card', copy, '--results', str(older), '--no-lipschitz']) == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"scores {weights}, not this export's model.safetensors "
        f"({os.path.realpath(os.path.join(copy, 'export', 'best', 'model.safetensors'))}) as far as its path tells: it "
        f"records no sha256 of the weights it scored (an older validate.py); score it with validate.py --checkpoint "
        f"{os.path.join(copy, 'export', 'best')} --results-file FILE")
    older.write_text(json.dumps(unhashed | {'checkpoint': os.path.join(copy, 'export', 'best', 'model.safetensors')}))
    assert hub_main(['card', copy, '--results', str(older), '--no-lipschitz']) == 0
    last = os.path.join(copy, 'export', 'last', 'model.safetensors')
    state = load_file(last)
    state = {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in state.items()}
    safetensors.torch.save_file(state, os.path.join(copy, 'export', 'best', 'model.safetensors'))
    assert hub_main(['card', copy, '--results', str(results), '--no-lipschitz']) == 2
    err = capsys.readouterr().err
    assert f'scores {weights} (sha256 {record["checkpoint_sha256"]}), not this export\'s model.safetensors' in err


def test_lipschitz_and_benchmark_take_local_dir(run_dir, tmp_path, capsys):
    export = os.path.join(run_dir, 'export', 'best')
    name = f'local-dir:{export}'
    assert expand_model_names(name) == [name]
    out = tmp_path / 'lipschitz.json'
    assert lipschitz_main(['--model', name, '--no-empirical', '--json', str(out)]) == 0
    alphas = [row['alpha'] for row in json.loads(out.read_text())['branches']]
    # The export's weights (the trained alphas), not an initialisation.
    assert alphas == [row['alpha'] for row in analyze(_export_model(export), empirical=False)['branches']]
    assert alphas != [row['alpha'] for row in analyze(timm.create_model(name), empirical=False)['branches']]
    (spec,) = parse_model_specs(name)
    built, inputs = _build(spec, BenchmarkConfig(batch_size=2, img_size=32))
    assert inputs.shape == (2, 1, 32, 32) and built(inputs).shape == (2, 4)


class _FakeDownloads:
    """timm's Hub downloads served from a local folder (as a repository's files), or failing as offline."""

    def __init__(self, monkeypatch, folder: str | None):
        def download(repo_id, filename, revision=None, cache_dir=None, **kwargs):
            path = os.path.join(folder or '', filename)
            if folder is None or not os.path.isfile(path):
                raise LocalEntryNotFoundError('cannot find the requested files in the local cache')
            self.requested.append((repo_id, filename))
            return path
        self.requested = []
        monkeypatch.setattr(timm.models._hub, 'hf_hub_download', download)


def test_hf_hub_names_up_to_the_download(run_dir, data_dir, monkeypatch):
    export = os.path.join(run_dir, 'export', 'best')
    expected = _logits(_export_model(export))
    downloads = _FakeDownloads(monkeypatch, export)
    model, _ = create_eval_model('hf-hub:me/tiny', None, pretrained=True)  # validate.py --model hf-hub:me/tiny
    assert torch.equal(_logits(model), expected)
    assert downloads.requested == [('me/tiny', 'config.json'), ('me/tiny', 'model.safetensors')]
    overrides = tiny_overrides(data_dir, **{'model.pretrained': True})
    config = load_config(None, [o for o in overrides if not o.startswith(('model.name=', 'model.kwargs='))]
                         + ['model.name=hf-hub:me/tiny'])
    model, _ = create_run_model(config, 4, resolve_input_spec(config))  # train.py's model.name
    assert torch.equal(_logits(model), expected)
    _FakeDownloads(monkeypatch, None)
    for build in (lambda: create_eval_model('hf-hub:me/tiny', None, pretrained=True),
                  lambda: create_model('hf-hub:me/tiny', pretrained=True)):
        with pytest.raises(ModelSourceError, match=r'cannot download the weights of hf-hub:me/tiny from the Hugging '
                                                   r'Face Hub repository me/tiny at .*pretrained_cfg_overlay=dict\('
                                                   r'file=.*python -m lipsformer.hub.convert .*local-dir:FOLDER'):
            build()


def test_convert_a_run_folder_raw_and_ema(run_dir, tmp_path):
    export = os.path.join(run_dir, 'export', 'best')
    convert(run_dir, str(tmp_path / 'raw'))
    result = convert(run_dir, str(tmp_path / 'ema'), use_ema=True)
    assert result['max_abs_logit_difference'] == 0.0
    for name, weights in (('raw', 'model.safetensors'), ('ema', 'model_ema.safetensors')):
        converted, exported = load_file(tmp_path / name / 'model.safetensors'), load_file(os.path.join(export, weights))
        assert converted.keys() == exported.keys()
        assert all(torch.equal(converted[key], exported[key]) for key in converted), name
    saved = json.loads((tmp_path / 'ema' / 'config.json').read_text())
    assert saved['label_names'] == ['class_0', 'class_1', 'class_2', 'class_3']
    assert saved['pretrained_cfg']['mean'] == [0.5] and saved['model_args']['in_chans'] == 1
