"""validate.py end to end on small real-image trees laid out like ImageNet val, ImageNet-V2 and ImageNet-ReaL.

Every number is compared for exact equality with an independent computation (validate_reference.py): the same
weights run on one batch of all images through timm's eval transform, top-k taken from the logits, labels from where
the test filed each image, accuracy as 100 * hits / count. Images are filed relative to the model's own predictions
(its top-1 class, its 5th class, or a class outside its top 5), so the expected accuracies are also known from first
principles.
"""
import copy
import dataclasses
import json
import os
import shutil
from pathlib import Path

import pytest
import safetensors.torch
import timm
import torch
import yaml
from accelerate.state import AcceleratorState
from image_data import make_image_folder
from imagenet_trees import build_tree, val_file_name, write_jpegs
from timm.models import save_for_hf
from timm.models._registry import _model_pretrained_cfgs
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN, SMALLEST_SWIN_KWARGS
from training_support import tiny_overrides, write_checkpoint_meta
from validate_reference import file_by_prediction, reference_accuracy, reference_topk

from lipsformer.evaluation import imagenet_synsets, load_real_labels
from lipsformer.evaluation.validate_command import main
from lipsformer.training import load_config, train
from lipsformer.weights.weight_files import load_model_weights

pytestmark = pytest.mark.usefixtures('one_thread')

NUM_IMAGES = 24
# test_vit's pretrained cfg at --img-size 32: what validate.py must default to.
VIT_DATA_CONFIG = dict(input_size=(3, 32, 32), interpolation='bicubic', mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5),
                       crop_pct=0.95, crop_mode='center')


def run_main(argv: list[str]) -> int:
    """validate.py's main in this process, with a fresh Accelerator state as a new process would have."""
    AcceleratorState._reset_state(reset_partial_state=True)
    return main(argv)


def run_validate(argv: list[str], tmp_path, capsys) -> dict:
    """Run validate.py, check its printed table against its JSON, and return the JSON."""
    results_file = str(tmp_path / 'results.json')
    assert run_main([*argv, '--batch-size', '10', '--workers', '0', '--results-file', results_file]) == 0
    header, *rows = capsys.readouterr().out.splitlines()
    with open(results_file) as f:
        record = json.load(f)
    assert header.split()[:4] == ['model', 'dataset', 'name', 'images']
    assert [row.split()[:8] for row in rows] == [
        [record['model'], r['dataset'], r['name'], str(r['images']), str(r['count']), str(len(r['skipped'])),
         f'{r["classes"]}/{r["num_classes"]}', f'{r["top1"]:.3f}'] for r in record['results']]
    return record


def by_dataset(record: dict) -> dict:
    return {(r['dataset'], r['name']): r for r in record['results']}


@dataclasses.dataclass(frozen=True)
class VitSetup:
    """A seeded test_vit, its checkpoint, real val-named JPEGs, their reference top-5 and a val tree filed by it."""
    model: torch.nn.Module
    checkpoint: str
    photos: list[str]
    topk: torch.Tensor
    classes: list[int]
    val: str

    @property
    def args(self) -> list[str]:
        return ['--model', 'test_vit', '--checkpoint', self.checkpoint, '--img-size', '32']


@pytest.fixture(scope='module')
def vit(tmp_path_factory) -> VitSetup:
    folder = tmp_path_factory.mktemp('vit')
    torch.manual_seed(0)
    model = timm.create_model('test_vit', img_size=32).eval()
    checkpoint = str(folder / 'vit.safetensors')
    safetensors.torch.save_file(model.state_dict(), checkpoint)
    photos = write_jpegs(str(folder / 'photos'), [val_file_name(i) for i in range(1, NUM_IMAGES + 1)])
    topk = reference_topk(model, photos, VIT_DATA_CONFIG)
    classes = file_by_prediction(topk)
    val = build_tree(str(folder / 'val'), dict(zip(photos, classes)))
    return VitSetup(model, checkpoint, photos, topk, classes, val)


def test_val_real_and_v2_in_one_run(vit, tmp_path, capsys):
    v2_numeric = build_tree(str(tmp_path / 'matched-frequency'), dict(zip(vit.photos, vit.classes)), layout='numeric')
    v2_synsets = build_tree(str(tmp_path / 'threshold0.7'), dict(zip(vit.photos, vit.classes)))
    record = run_validate([*vit.args, '--data-dir', vit.val, '--real-labels', '--v2-dir', v2_numeric, v2_synsets],
                          tmp_path, capsys)

    assert record['model'] == 'test_vit' and record['checkpoint'] == vit.checkpoint
    settings = record['settings']
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in settings.items() if k in VIT_DATA_CONFIG} \
        == VIT_DATA_CONFIG
    assert settings['num_processes'] == 1 and settings['batch_size'] == 10
    assert record['versions']['timm'] == timm.__version__ and record['versions']['torch']
    results = by_dataset(record)
    assert set(results) == {('imagenet', 'val'), ('imagenet-real', 'val'), ('imagenet-v2', 'matched-frequency'),
                            ('imagenet-v2', 'threshold0.7')}

    expected = reference_accuracy(vit.topk, [[c] for c in vit.classes])
    # First principles: a third of the images are filed under their top-1 class, two thirds within their top 5.
    assert expected == {'count': NUM_IMAGES, 'top1': 100.0 / 3, 'top5': 200.0 / 3}
    for key in [('imagenet', 'val'), ('imagenet-v2', 'matched-frequency'), ('imagenet-v2', 'threshold0.7')]:
        result = results[key]
        assert {k: result[k] for k in expected} == expected, key
        assert result['images'] == NUM_IMAGES and result['skipped'] == [] and result['images_per_s'] > 0
    assert results[('imagenet-v2', 'matched-frequency')]['path'] == v2_numeric

    real = load_real_labels()
    expected_real = reference_accuracy(vit.topk, [real[os.path.basename(p)] for p in vit.photos])
    assert expected_real['count'] == NUM_IMAGES - 2  # val images 1 and 22 have empty ReaL label sets
    assert {k: results[('imagenet-real', 'val')][k] for k in expected_real} == expected_real


def test_subsets_of_the_synset_and_v2_folders_are_scored_by_name(vit, tmp_path, capsys):
    """An Imagenette-style tree (only the synset folders that hold images) and a V2 tree with only some numbered
    folders: each folder's name fixes its class, so the scores equal those of the full trees."""
    placements = dict(zip(vit.photos, vit.classes))
    val = build_tree(str(tmp_path / 'imagenette'), placements, subset=True)
    v2 = build_tree(str(tmp_path / 'v2-part'), placements, layout='numeric', subset=True)
    present = len(set(vit.classes))
    assert 3 <= present < 1000 and len(os.listdir(val)) == len(os.listdir(v2)) == present
    record = run_validate([*vit.args, '--data-dir', val, '--real-labels', '--v2-dir', v2], tmp_path, capsys)
    expected = reference_accuracy(vit.topk, [[c] for c in vit.classes])
    for result in record['results']:
        assert (result['classes'], result['num_classes']) == (present, 1000), result['dataset']
        if result['dataset'] != 'imagenet-real':
            assert {k: result[k] for k in expected} == expected, result['dataset']
    os.makedirs(os.path.join(val, 'n99999999'))  # a name that is no synset stays an error
    err = _fails([*vit.args, '--data-dir', val], capsys)
    assert '1 of its' in err and 'not ImageNet-1k synsets: n99999999' in err and 'any subset' in err
    os.makedirs(os.path.join(v2, '1000'))
    assert 'not class indices: 1000' in _fails([*vit.args, '--v2-dir', v2], capsys)


def test_v2_numeric_folders_are_not_string_sorted(vit, tmp_path, capsys):
    top1 = vit.topk[:, 0].tolist()
    string_sorted = sorted(str(i) for i in range(1000))
    # The trap is live: under a string sort most of these folders would stand for other classes.
    assert sum(string_sorted[c] != str(c) for c in top1) >= NUM_IMAGES - 2
    v2 = build_tree(str(tmp_path / 'top-images'), dict(zip(vit.photos, top1)), layout='numeric')
    (result,) = run_validate([*vit.args, '--v2-dir', v2], tmp_path, capsys)['results']
    assert result['dataset'] == 'imagenet-v2' and result['top1'] == 100.0 and result['top5'] == 100.0


def test_real_labels_file(vit, tmp_path, capsys):
    real = json.loads(json.dumps(load_real_labels()))
    # ReaL sets holding the top-1 class, the 3rd, nothing the model ranks in its top 5, or nothing at all.
    designs = []
    for i, (photo, row) in enumerate(zip(vit.photos, vit.topk.tolist())):
        outside = next(c for c in range(1000) if c not in row)
        designs.append([[row[0], outside], [row[2]], [outside], []][i % 4])
        real[os.path.basename(photo)] = designs[-1]
    real_file = tmp_path / 'real.json'
    real_file.write_text(json.dumps([real[val_file_name(i)] for i in range(1, 50_001)]))  # published list format
    record = run_validate([*vit.args, '--data-dir', vit.val, '--real-labels', str(real_file)], tmp_path, capsys)
    expected = reference_accuracy(vit.topk, designs)
    # 24 images, 6 of each design: 18 counted, 6 right at top 1, 12 within the top 5.
    assert expected == {'count': 18, 'top1': 100.0 / 3, 'top5': 200.0 / 3}
    result = by_dataset(record)[('imagenet-real', 'val')]
    assert {k: result[k] for k in expected} == expected


def test_corrupt_images_are_skipped_and_reported(vit, tmp_path, capsys):
    val = build_tree(str(tmp_path / 'val'), dict(zip(vit.photos[:12], vit.classes[:12])))
    synset = imagenet_synsets()[vit.classes[0]]
    junk = os.path.join(val, synset, val_file_name(901))
    with open(junk, 'wb') as f:
        f.write(b'not a JPEG at all')
    truncated = os.path.join(val, synset, val_file_name(902))
    with open(vit.photos[0], 'rb') as f:
        data = f.read()
    with open(truncated, 'wb') as f:
        f.write(data[:len(data) // 2])
    record = run_validate([*vit.args, '--data-dir', val, '--real-labels'], tmp_path, capsys)
    results = by_dataset(record)
    val_result = results[('imagenet', 'val')]
    assert val_result['images'] == 14 and val_result['skipped'] == [junk, truncated]
    expected = reference_accuracy(vit.topk[:12], [[c] for c in vit.classes[:12]])
    assert {k: val_result[k] for k in expected} == expected
    assert results[('imagenet-real', 'val')]['skipped'] == [junk, truncated]


def test_tiffs_are_read_and_every_file_left_out_is_named_as_skipped(vit, tmp_path, capsys):
    """TIFFs (8-bit RGB and 16-bit grey) score as their 8-bit PNG copies; a file of another type, a file in a folder
    inside a class folder and links that point nowhere are each counted in ``images`` and named in ``skipped``."""
    import numpy as np
    from PIL import Image
    placements = dict(zip(vit.photos[:12], vit.classes[:12]))
    pngs, tiffs = build_tree(str(tmp_path / 'pngs'), placements), build_tree(str(tmp_path / 'tiffs'), placements)
    for index, photo in enumerate(vit.photos[:12]):
        with Image.open(photo) as image:
            pixels = np.asarray(image.convert('RGB' if index % 2 else 'L'))
        for tree in (pngs, tiffs):
            jpeg = os.path.join(tree, imagenet_synsets()[vit.classes[index]], os.path.basename(photo))
            os.remove(jpeg)
            stem = os.path.splitext(jpeg)[0]
            if tree == pngs:
                Image.fromarray(pixels).save(stem + '.png')
            elif index % 2:
                Image.fromarray(pixels).save(stem + '.tif')
            else:  # each 8-bit value v as v * 257, which the reader maps back to v
                Image.fromarray(pixels.astype(np.uint16) * 257).save(stem + '.TIFF')
    expected = by_dataset(run_validate([*vit.args, '--data-dir', pngs], tmp_path, capsys))[('imagenet', 'pngs')]
    result = by_dataset(run_validate([*vit.args, '--data-dir', tiffs], tmp_path, capsys))[('imagenet', 'tiffs')]
    assert result['images'] == 12 and result['skipped'] == [] and result['count'] == 12
    assert {k: result[k] for k in ('top1', 'top5')} == {k: expected[k] for k in ('top1', 'top5')}

    val = build_tree(str(tmp_path / 'val'), placements)
    synset = os.path.join(val, imagenet_synsets()[vit.classes[0]])
    notes, nested = os.path.join(synset, 'notes.txt'), os.path.join(synset, 'more', 'extra.JPEG')
    with open(notes, 'w') as f:
        f.write('not an image')
    os.makedirs(os.path.dirname(nested))
    shutil.copy(vit.photos[0], nested)
    dangling_image, dangling_other = os.path.join(synset, 'gone.JPEG'), os.path.join(synset, 'gone.dat')
    os.symlink(str(tmp_path / 'nowhere.JPEG'), dangling_image)
    os.symlink(str(tmp_path / 'nowhere.dat'), dangling_other)
    result = by_dataset(run_validate([*vit.args, '--data-dir', val], tmp_path, capsys))[('imagenet', 'val')]
    assert result['images'] == 16 and result['count'] == 12
    assert sorted(result['skipped']) == sorted([notes, nested, dangling_image, dangling_other])


def test_settings_override_the_pretrained_cfg(vit, tmp_path, capsys):
    data_config = dict(VIT_DATA_CONFIG, input_size=(3, 48, 48), crop_pct=1.0, interpolation='bilinear')
    expected = reference_accuracy(reference_topk(vit.model, vit.photos, data_config), [[c] for c in vit.classes])
    record = run_validate(['--model', 'test_vit', '--checkpoint', vit.checkpoint, '--img-size', '48',
                           '--crop-pct', '1', '--interpolation', 'bilinear', '--data-dir', vit.val], tmp_path, capsys)
    settings = record['settings']
    assert (settings['input_size'], settings['crop_pct'], settings['interpolation']) == ([3, 48, 48], 1.0, 'bilinear')
    (result,) = record['results']
    assert {k: result[k] for k in expected} == expected


def test_csv_results(vit, tmp_path):
    csv_file = tmp_path / 'results.csv'
    assert run_main([*vit.args, '--data-dir', vit.val, '--real-labels', '--workers', '0',
                     '--results-file', str(csv_file), '--results-format', 'csv']) == 0
    header, *rows = [line.split(',') for line in csv_file.read_text().splitlines()]
    assert header[:12] == ['model', 'checkpoint', 'use_ema', 'dataset', 'name', 'path', 'images', 'count',
                           'classes', 'num_classes', 'top1', 'top5']
    assert [row[3] for row in rows] == ['imagenet', 'imagenet-real']
    assert rows[0][6:12] == [str(NUM_IMAGES), str(NUM_IMAGES), str(len(set(vit.classes))), '1000', str(100.0 / 3),
                             str(200.0 / 3)]


def _export(model: torch.nn.Module, folder: str, ema: torch.nn.Module | None = None) -> None:
    """A run export as train.py writes it: timm's save_for_hf files plus the EMA weights."""
    save_for_hf(model, folder, safe_serialization=True, data_config={'img_size': 32})
    if ema is not None:
        safetensors.torch.save_file(ema.state_dict(), os.path.join(folder, 'model_ema.safetensors'))


def _tiny_lipsformer() -> torch.nn.Module:
    return timm.create_model(SMALLEST_MODEL, **SMALLEST_SWIN).eval()


def _perturbed(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    """A copy whose classifier moved, as EMA or later weights of the same run would have."""
    other = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        head = other.get_classifier()
        head.weight.add_(torch.randn(head.weight.shape, generator=generator) * head.weight.std())
    return other


@dataclasses.dataclass(frozen=True)
class RunSetup:
    """A training run's three weights of one tiny LipsFormer, a val tree filed by the raw weights' predictions and the
    accuracies each set of weights must score on it."""
    raw: torch.nn.Module
    ema: torch.nn.Module
    last: torch.nn.Module
    val: str
    expected_raw: dict
    expected_ema: dict


@pytest.fixture(scope='module')
def run_weights(vit, tmp_path_factory) -> RunSetup:
    raw = _tiny_lipsformer()
    ema, last = _perturbed(raw, 1), _perturbed(raw, 2)
    photos = vit.photos[:12]
    data_config = dict(VIT_DATA_CONFIG, mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225), crop_pct=0.875)
    raw_topk, ema_topk = reference_topk(raw, photos, data_config), reference_topk(ema, photos, data_config)
    classes = file_by_prediction(raw_topk)
    val = build_tree(str(tmp_path_factory.mktemp('run_val')), dict(zip(photos, classes)))
    expected_raw = reference_accuracy(raw_topk, [[c] for c in classes])
    expected_ema = reference_accuracy(ema_topk, [[c] for c in classes])
    assert expected_raw == {'count': 12, 'top1': 100.0 / 3, 'top5': 200.0 / 3} and expected_ema != expected_raw
    return RunSetup(raw, ema, last, val, expected_raw, expected_ema)


def _exported_run(weights: RunSetup, run) -> None:
    _export(weights.raw, str(run / 'export' / 'best'), ema=weights.ema)
    _export(weights.last, str(run / 'export' / 'last'))


def test_run_folder_best_export_rebuilt_from_its_config_json(run_weights, tmp_path, capsys):
    """No --model: the export's config.json rebuilds the tiny architecture and its 32px preprocessing."""
    run = tmp_path / 'run'
    _exported_run(run_weights, run)
    record = run_validate(['--checkpoint', str(run), '--data-dir', run_weights.val], tmp_path, capsys)
    assert record['model'] == 'lipsformer_swin_tiny'
    assert record['checkpoint'] == str(run / 'export' / 'best' / 'model.safetensors')
    assert record['settings']['input_size'] == [3, 32, 32]
    assert {k: record['results'][0][k] for k in run_weights.expected_raw} == run_weights.expected_raw


def test_run_folder_ema_weights_of_the_best_export(run_weights, tmp_path, capsys):
    run = tmp_path / 'run'
    _exported_run(run_weights, run)
    record = run_validate(['--model', 'lipsformer_swin_tiny', '--checkpoint', str(run), '--use-ema',
                           '--data-dir', run_weights.val], tmp_path, capsys)
    assert record['checkpoint'] == str(run / 'export' / 'best' / 'model_ema.safetensors')
    assert record['settings']['use_ema'] is True
    assert {k: record['results'][0][k] for k in run_weights.expected_ema} == run_weights.expected_ema


def test_run_folder_with_checkpoints_only_takes_the_newest(run_weights, tmp_path, capsys):
    """A run with resumable checkpoints only: the newest one, rebuilt from the run's resolved config.yaml."""
    run = tmp_path / 'checkpoints_run'
    saved = run / 'checkpoints'
    for name, weights in (('step_200', run_weights.raw), ('step_100', run_weights.last)):
        os.makedirs(saved / name)
        safetensors.torch.save_file(weights.state_dict(), str(saved / name / 'model.safetensors'))
    safetensors.torch.save_file(run_weights.ema.state_dict(), str(saved / 'step_200' / 'ema.safetensors'))
    write_checkpoint_meta(saved / 'step_200', step=200)
    write_checkpoint_meta(saved / 'step_100', step=100)
    (run / 'config.yaml').write_text(yaml.safe_dump({
        'model': {'name': SMALLEST_MODEL, 'kwargs': SMALLEST_SWIN_KWARGS,
                  'img_size': 32, 'in_chans': 3, 'num_classes': None},
        'data': {'mean': None, 'std': None, 'interpolation': 'bicubic', 'crop_pct': None}}))
    record = run_validate(['--checkpoint', str(run), '--use-ema', '--data-dir', run_weights.val], tmp_path,
                          capsys)
    assert record['checkpoint'] == str(saved / 'step_200' / 'ema.safetensors')
    assert record['settings']['input_size'] == [3, 32, 32]
    assert {k: record['results'][0][k] for k in run_weights.expected_ema} == run_weights.expected_ema


def test_training_checkpoint_with_ema_entry(vit, tmp_path, capsys):
    """A timm-style .pth.tar holding state_dict and state_dict_ema; --use-ema takes the EMA entry."""
    torch.manual_seed(5)
    other = timm.create_model('test_vit', img_size=32).eval()
    checkpoint = tmp_path / 'checkpoint.pth.tar'
    torch.save({'state_dict': other.state_dict(), 'state_dict_ema': vit.model.state_dict(), 'epoch': 3}, checkpoint)
    labels = [[c] for c in vit.classes]
    expected_ema = reference_accuracy(vit.topk, labels)
    expected_raw = reference_accuracy(reference_topk(other, vit.photos, VIT_DATA_CONFIG), labels)
    assert expected_raw != expected_ema
    args = ['--model', 'test_vit', '--checkpoint', str(checkpoint), '--img-size', '32', '--data-dir', vit.val]
    (result,) = run_validate([*args, '--use-ema'], tmp_path, capsys)['results']
    assert {k: result[k] for k in expected_ema} == expected_ema
    (result,) = run_validate(args, tmp_path, capsys)['results']
    assert {k: result[k] for k in expected_raw} == expected_raw


def _fails(argv: list[str], capsys) -> str:
    assert run_main([*argv, '--workers', '0']) == 2
    return capsys.readouterr().err


def test_wrong_architecture_or_class_count_is_a_clear_error(vit, tmp_path, capsys):
    checkpoint, val = vit.checkpoint, vit.val
    err = _fails(['--model', 'test_convnext', '--checkpoint', checkpoint, '--data-dir', val], capsys)
    assert 'does not fit ConvNeXt' in err and 'missing: stem.0.weight' in err and 'unexpected: blocks.0.attn' in err

    ten_classes = tmp_path / 'ten.safetensors'
    safetensors.torch.save_file(timm.create_model('test_vit', num_classes=10).state_dict(), str(ten_classes))
    err = _fails(['--model', 'test_vit', '--checkpoint', str(ten_classes), '--data-dir', val], capsys)
    assert 'shape mismatch: head.bias' in err and 'head.weight: checkpoint (10, 64) vs model (1000, 64)' in err

    export = tmp_path / 'export10'
    save_for_hf(timm.create_model('test_vit', num_classes=10), str(export), safe_serialization=True)
    err = _fails(['--checkpoint', str(export), '--data-dir', val], capsys)
    assert 'the model has 10 outputs but imagenet' in err and '1000 classes' in err

    err = _fails(['--model', 'resnet10t', '--checkpoint', str(export), '--data-dir', val], capsys)
    assert '--model resnet10t does not match the checkpoint' in err and 'test_vit' in err


def test_bad_data_arguments_fail_before_inference(vit, tmp_path, capsys):
    photos = vit.photos
    base = ['--model', 'test_vit', '--checkpoint', vit.checkpoint]
    assert 'does not exist' in _fails([*base, '--data-dir', str(tmp_path / 'missing')], capsys)
    assert 'no images' in _fails([*base, '--data-dir', build_tree(str(tmp_path / 'empty'), {})], capsys)
    assert 'nothing to evaluate' in _fails(base, capsys)
    renamed = build_tree(str(tmp_path / 'renamed'), {photos[0]: 3})
    shutil.move(os.path.join(renamed, imagenet_synsets()[3], os.path.basename(photos[0])),
                os.path.join(renamed, imagenet_synsets()[3], 'tench.jpg'))
    assert 'ILSVRC2012_val_%08d.JPEG' in _fails([*base, '--data-dir', renamed, '--real-labels'], capsys)
    assert '--use-ema needs --checkpoint' in _fails(['--model', 'test_vit', '--use-ema', '--v2-dir', renamed], capsys)
    assert 'one model' in _fails(['--model', 'test_vit,resnet10t', *base[2:], '--data-dir', renamed], capsys)
    assert 'test_vit4 has no pretrained weights registered with timm; pass --checkpoint' in _fails(
        ['--model', 'test_vit4', '--data-dir', renamed], capsys)
    assert '--amp fp16 runs only on a GPU' in _fails([*base, '--data-dir', renamed, '--amp', 'fp16', '--cpu'], capsys)


def test_authors_pth_on_a_class_folder_data_set(tmp_path, capsys):
    """The authors' .pth (with its pickled yacs config) scored on a 10-class folder tree (--data-layout imagefolder)."""
    path = os.path.join(os.path.dirname(__file__), 'fixtures', 'authors', 'authors_checkpoint_swin_small.pth')
    kwargs = dict(embed_dim=12, depths=(1, 1, 2, 1), num_heads=(1, 2, 3, 6), window_size=4, img_size=64)
    model = timm.create_model('lipsformer_swin_tiny', num_classes=10, **kwargs).eval()
    load_model_weights(model, path)
    photos = write_jpegs(str(tmp_path / 'photos'), [f'item{i}.jpg' for i in range(12)])
    data_config = dict(VIT_DATA_CONFIG, input_size=(3, 64, 64), mean=(0.485, 0.456, 0.406),
                       std=(0.229, 0.224, 0.225), crop_pct=0.875)
    with torch.no_grad():
        topk = reference_topk(model, photos, data_config)
    classes = file_by_prediction(topk)
    for i in range(10):
        os.makedirs(tmp_path / 'data' / f'class{i}')
    for photo, c in zip(photos, classes):
        shutil.copyfile(photo, tmp_path / 'data' / f'class{c}' / os.path.basename(photo))
    model_kwargs = [f'{k}={v}'.replace(' ', '') for k, v in kwargs.items()]
    record = run_validate(['--model', 'lipsformer_swin_tiny', '--checkpoint', path, '--num-classes', '10',
                           '--model-kwargs', *model_kwargs, '--img-size', '64', '--data-layout', 'imagefolder',
                           '--data-dir', str(tmp_path / 'data')], tmp_path, capsys)
    (result,) = record['results']
    assert result['dataset'] == 'imagefolder'
    assert {k: result[k] for k in ('count', 'top1', 'top5')} == {'count': 12, 'top1': 100.0 / 3, 'top5': 200.0 / 3}


def test_several_models_with_pretrained_weights(vit, tmp_path, capsys, monkeypatch):
    """A comma list of models, each with its timm pretrained weights (pointed at local files here)."""
    torch.manual_seed(1)
    convnext = timm.create_model('test_convnext').eval()
    convnext_file = str(tmp_path / 'convnext.safetensors')
    safetensors.torch.save_file(convnext.state_dict(), convnext_file)
    for name, file in (('test_vit.r160_in1k', vit.checkpoint), ('test_convnext.r160_in1k', convnext_file)):
        cfg = _model_pretrained_cfgs[name]
        monkeypatch.setitem(_model_pretrained_cfgs, name, dataclasses.replace(cfg, file=file, hf_hub_id=None, url=None))
    cfg = _model_pretrained_cfgs['test_convnext.r160_in1k']
    convnext_config = dict(input_size=(3, 32, 32), interpolation=cfg.interpolation, mean=cfg.mean, std=cfg.std,
                           crop_pct=cfg.crop_pct, crop_mode=cfg.crop_mode)
    labels = [[c] for c in vit.classes]
    expected = {'test_vit.r160_in1k': reference_accuracy(vit.topk, labels),
                'test_convnext.r160_in1k': reference_accuracy(
                    reference_topk(convnext, vit.photos, convnext_config), labels)}
    results_file = tmp_path / 'results.json'
    assert run_main(['--model', 'test_vit.r160_in1k,test_convnext.r160_in1k', '--img-size', '32',
                     '--data-dir', vit.val, '--workers', '0', '--results-file', str(results_file)]) == 0
    records = json.loads(results_file.read_text())
    assert [r['model'] for r in records] == ['test_vit.r160_in1k', 'test_convnext.r160_in1k']
    for record in records:
        assert record['checkpoint'] is None
        (result,) = record['results']
        assert {k: result[k] for k in ('count', 'top1', 'top5')} == expected[record['model']]
    assert len(capsys.readouterr().out.splitlines()) == 3  # header and one row per model


def test_bf16_and_channels_last(vit, tmp_path, capsys):
    """Mixed precision on CPU: the numbers of the same bf16 autocast computation on one batch."""
    with torch.autocast('cpu', dtype=torch.bfloat16):
        topk = reference_topk(vit.model, vit.photos, VIT_DATA_CONFIG, min_margin=None)
    expected = reference_accuracy(topk, [[c] for c in vit.classes])
    results_file = tmp_path / 'results.json'
    assert run_main([*vit.args, '--data-dir', vit.val, '--amp', 'bf16', '--channels-last', '--batch-size', '24',
                     '--workers', '0', '--results-file', str(results_file)]) == 0
    record = json.loads(results_file.read_text())
    assert record['settings']['amp'] == 'bf16' and record['settings']['channels_last'] is True
    (result,) = record['results']
    assert {k: result[k] for k in expected} == expected


def _export_with_shuffled_class_names(vit, tmp_path) -> tuple[str, list[str], list[int], Path]:
    """A test_vit export whose saved class names are numbered out of their sorted (and natural) order (index 1 is
    kind_7), and a class-folder tree of the photos, each under the class the model predicts for it: (export, names,
    predicted indices, data folder)."""
    torch.manual_seed(3)
    model = timm.create_model('test_vit', img_size=32, num_classes=10).eval()
    names = [f'kind_{(7 * i) % 10}' for i in range(10)]
    export = str(tmp_path / 'export')
    save_for_hf(model, export, model_config={'label_names': names}, safe_serialization=True)
    predicted = reference_topk(model, vit.photos, VIT_DATA_CONFIG)[:, 0].tolist()
    assert len(set(predicted)) > 1
    data = tmp_path / 'data'
    for photo, index in zip(vit.photos, predicted):
        os.makedirs(data / names[index], exist_ok=True)
        shutil.copyfile(photo, data / names[index] / os.path.basename(photo))
    return export, names, predicted, data


def test_class_folders_are_labelled_by_the_class_names_saved_with_the_weights(vit, tmp_path, capsys):
    """A model right on every image scores 100%, whatever order its classes were numbered in and whichever class
    folders are missing; by folder position (natural sort) it would score less."""
    export, names, predicted, data = _export_with_shuffled_class_names(vit, tmp_path)
    args = ['--checkpoint', export, '--img-size', '32', '--data-layout', 'imagefolder', '--data-dir', str(data)]
    (result,) = run_validate(args, tmp_path, capsys)['results']
    assert (result['count'], result['top1']) == (24, 100.0)
    shutil.rmtree(data / names[predicted[0]])
    (result,) = run_validate(args, tmp_path, capsys)['results']
    assert result['count'] == 24 - predicted.count(predicted[0]) and result['top1'] == 100.0
    os.makedirs(data / 'kind_x')
    shutil.copyfile(vit.photos[0], data / 'kind_x' / 'x.jpg')
    assert ("class folders that are not among the classes saved with the model's weights: kind_x (the classes "
            "saved with the model's weights: kind_0, kind_1, kind_2,") in _fails(args, capsys)
    err = _fails(['--checkpoint', export, '--img-size', '32', '--data-dir', vit.val], capsys)
    assert 'the model has 10 outputs but imagenet' in err  # its names are no synsets: the layout's labels stand


@pytest.fixture(scope='module')
def stopped_run(data_dir, tmp_path_factory) -> str:
    """A run with checkpoints only (no export) whose config.yaml says num_classes: null."""
    run_dir = str(tmp_path_factory.mktemp('stopped'))
    train(load_config(None, tiny_overrides(data_dir, **{'train.epochs': 1, 'checkpoint.export': False})), run_dir)
    assert not os.path.exists(os.path.join(run_dir, 'export'))
    assert load_config(os.path.join(run_dir, 'config.yaml')).model.num_classes is None
    return run_dir


def test_a_run_without_export_is_rebuilt_from_its_checkpoint(stopped_run, data_dir, tmp_path, capsys):
    """The class count (and names) come from the checkpoint; the score is the training's own evaluation of it."""
    val = str(tmp_path / 'val')
    shutil.copytree(os.path.join(data_dir, 'validation'), val)
    args = ['--checkpoint', stopped_run, '--data-layout', 'imagefolder', '--data-dir', val]
    record = run_validate(args, tmp_path, capsys)
    assert record['model'] == SMALLEST_MODEL and record['checkpoint'].endswith('epoch_0001/model.safetensors')
    (whole,) = record['results']
    with open(os.path.join(stopped_run, 'metrics.jsonl')) as f:
        trained = json.loads(f.readline())
    assert (whole['count'], whole['top1']) == (24, trained['val_top1'])
    # Scored by class name, the images of class_1 alone and those of the other classes add up to the whole.
    only, rest = tmp_path / 'only_class_1', tmp_path / 'without_class_1'
    shutil.copytree(os.path.join(val, 'class_1'), only / 'class_1')
    shutil.copytree(val, rest, ignore=lambda folder, names: ['class_1'] if folder == val else [])
    hits = [run_validate([*args[:-1], str(folder)], tmp_path, capsys)['results'][0] for folder in (only, rest)]
    assert [r['count'] for r in hits] == [6, 18]
    assert sum(r['count'] * r['top1'] for r in hits) == pytest.approx(24 * whole['top1'])


def test_timm_flags_amp_dtype_torchcompile_and_result_columns(vit, tmp_path, capsys):
    """timm's bare --amp with --amp-dtype, --torchcompile, and timm's result columns."""
    with torch.autocast('cpu', dtype=torch.bfloat16):
        topk = reference_topk(vit.model, vit.photos, VIT_DATA_CONFIG, min_margin=None)
    expected = reference_accuracy(topk, [[c] for c in vit.classes])
    record = run_validate([*vit.args, '--data-dir', vit.val, '--amp', '--amp-dtype', 'bfloat16', '--torchcompile',
                           'eager'], tmp_path, capsys)
    assert record['settings']['amp'] == 'bf16' and record['settings']['torchcompile'] == 'eager'
    (result,) = record['results']
    assert {k: result[k] for k in expected} == expected
    params = round(sum(p.numel() for p in vit.model.parameters()) / 1e6, 2)
    assert record['param_count'] == params
    assert {k: result[k] for k in ('top1_err', 'top5_err', 'param_count', 'img_size', 'crop_pct', 'interpolation')} \
        == {'top1_err': round(100 - expected['top1'], 4), 'top5_err': round(100 - expected['top5'], 4),
            'param_count': params, 'img_size': 32, 'crop_pct': 0.95, 'interpolation': 'bicubic'}
    assert 'runs only on a GPU' in _fails([*vit.args, '--data-dir', vit.val, '--amp'], capsys)  # float16, as timm
    assert 'disagree' in _fails([*vit.args, '--data-dir', vit.val, '--amp', 'bf16', '--amp-dtype', 'float16'], capsys)
    assert 'not a torch.compile backend' in _fails([*vit.args, '--data-dir', vit.val, '--torchcompile', 'nope'],
                                                   capsys)
    csv_file = tmp_path / 'results.csv'
    assert run_main([*vit.args, '--data-dir', vit.val, '--workers', '0', '--results-file', str(csv_file),
                     '--results-format', 'csv']) == 0
    header = csv_file.read_text().splitlines()[0].split(',')
    assert {'top1', 'top1_err', 'top5', 'top5_err', 'param_count', 'img_size', 'crop_pct', 'interpolation'} <= set(
        header)


def test_a_torchvision_dataset_through_timms_create_dataset(tmp_path, capsys):
    """--dataset torch/image_folder (torchvision's ImageFolder, opened by timm's create_dataset) scores the same as
    the class-folder layout over the same folder: labels from the dataset, predictions from the same model."""
    data = make_image_folder(str(tmp_path / 'data'))
    torch.manual_seed(5)
    model = timm.create_model('test_vit', img_size=32, num_classes=4).eval()
    checkpoint = str(tmp_path / 'vit4.safetensors')
    safetensors.torch.save_file(model.state_dict(), checkpoint)
    args = ['--model', 'test_vit', '--checkpoint', checkpoint, '--img-size', '32', '--num-classes', '4',
            '--data-dir', os.path.join(data, 'validation')]
    folder = run_validate([*args, '--data-layout', 'imagefolder'], tmp_path, capsys)['results'][0]
    (result,) = run_validate([*args, '--dataset', 'torch/image_folder', '--split', 'validation'], tmp_path,
                             capsys)['results']
    assert result['dataset'] == 'torch/image_folder' and result['name'] == 'validation'
    assert (result['images'], result['classes'], result['num_classes']) == (24, 4, 4)
    assert {k: result[k] for k in ('count', 'top1', 'top5')} == {k: folder[k] for k in ('count', 'top1', 'top5')}
    assert 0 < result['top5'] and result['top1'] < 100
    err = _fails([*args, '--dataset', 'torch/image_folder', '--real-labels'], capsys)
    assert '--real-labels scores ImageNet val' in err
    err = _fails(['--model', 'test_vit', '--checkpoint', checkpoint, '--num-classes', '4', '--dataset',
                  'torch/fashion_mnist', '--split', 'dev', '--data-dir', str(tmp_path / 'fm')], capsys)
    assert "--dataset torch/fashion_mnist: data.split: 'dev' is not a split" in err


def test_an_unwritable_results_file_is_refused_before_the_evaluation(vit, tmp_path, capsys, monkeypatch):
    def no_evaluation(*args, **kwargs):
        raise AssertionError('evaluated although the results file cannot be written')

    monkeypatch.setattr('lipsformer.evaluation.validate_command._evaluate_model', no_evaluation)
    base = [*vit.args, '--data-dir', vit.val]
    err = _fails([*base, '--results-file', str(tmp_path)], capsys)
    assert f'--results-file {str(tmp_path)!r} cannot be written: it is a folder' in err
    a_file = tmp_path / 'a_file'
    a_file.write_text('')
    err = _fails([*base, '--results-file', str(a_file / 'results.json')], capsys)
    assert f'{str(a_file)!r} is a file, not a folder' in err


def test_a_failed_results_write_keeps_the_table_and_exits_as_train_py(vit, tmp_path, capsys, monkeypatch):
    def read_only(path, records, results_format='json'):
        raise OSError(30, 'Read-only file system', path)

    monkeypatch.setattr('lipsformer.evaluation.validate_command.write_results', read_only)
    results_file = str(tmp_path / 'results.json')
    assert run_main([*vit.args, '--data-dir', vit.val, '--workers', '0', '--results-file', results_file]) == 4
    out, err = capsys.readouterr()
    header, row = out.splitlines()
    assert header.split()[:2] == ['model', 'dataset'] and row.split()[:3] == ['test_vit', 'imagenet', 'val']
    assert f'--results-file {results_file!r}: Read-only file system; the table above holds them' in err
    assert 'Traceback' not in err


def test_default_workers_fit_the_cpus_the_process_may_use():
    from lipsformer.evaluation.validate_command import build_validate_parser
    assert build_validate_parser().parse_args([]).workers == min(4, len(os.sched_getaffinity(0)))


def test_a_rejected_model_keyword_is_a_one_line_error_naming_it(vit, capsys):
    err = _fails(['--model', 'test_vit', '--checkpoint', vit.checkpoint, '--data-dir', vit.val, '--img-size', '32',
                  '--model-kwargs', 'depth=1', 'window_size=7'], capsys)
    assert "error: --model-kwargs: test_vit does not accept ['window_size'] (" in err and 'Traceback' not in err


def test_an_input_size_the_model_cannot_take_is_refused_before_inference(vit, tmp_path, capsys):
    """--img-size 48 for a LipsFormer (heights and widths multiples of 32): exit 2, one line naming the sizes that
    fit nearest to it, whether the size reaches the constructor or only the forward."""
    model = timm.create_model(SMALLEST_MODEL, **SMALLEST_SWIN)
    checkpoint = str(tmp_path / 'swin.safetensors')
    safetensors.torch.save_file(model.state_dict(), checkpoint)
    kwargs = [f'{key}={",".join(map(str, value)) if isinstance(value, list) else value}'
              for key, value in SMALLEST_SWIN_KWARGS.items()]
    base = ['--model', SMALLEST_MODEL, '--checkpoint', checkpoint, '--data-dir', vit.val, '--model-kwargs', *kwargs]
    err = _fails([*base, '--img-size', '48'], capsys)
    assert err.endswith('error: input size 48x48 (--img-size / --input-size, else the pretrained cfg): the model '
                        'takes heights and widths that are multiples of 32, because its patch embedding and the '
                        'downsampling between its stages shrink the image 32-fold and each must divide it evenly; did '
                        'you mean 32 or 64?\n')
    assert err.count('\n') == 1
    err = _fails([*base, '--input-size', '3', '64', '80'], capsys)
    assert 'evenly; did you mean 64 or 96?' in err and 'Traceback' not in err
    err = _fails([*base, 'img_size=50'], capsys)
    assert err.endswith(f'error: {SMALLEST_MODEL} cannot be built with these arguments: img_size must be a multiple '
                        f'of 32, got 50x50\n')


def test_an_input_size_too_large_for_memory_is_a_one_line_error_naming_the_batch_and_size(vit, tmp_path, capsys):
    """A mistyped --img-size (2**24: a multiple of 32, so the model takes it) asks for petabytes: exit 2 and one line
    naming the batch, the size and the options to lower, not the allocator's traceback."""
    model = timm.create_model(SMALLEST_MODEL, **SMALLEST_SWIN)
    checkpoint = str(tmp_path / 'swin.safetensors')
    safetensors.torch.save_file(model.state_dict(), checkpoint)
    kwargs = [f'{key}={",".join(map(str, value)) if isinstance(value, list) else value}'
              for key, value in SMALLEST_SWIN_KWARGS.items()]
    err = _fails(['--model', SMALLEST_MODEL, '--checkpoint', checkpoint, '--data-dir', vit.val, '--model-kwargs',
                  *kwargs, '--img-size', str(2 ** 24), '-b', '2'], capsys)
    assert err.count('\n') == 1 and 'Traceback' not in err, err
    assert f'error: a batch of 2 images of 3x{2 ** 24}x{2 ** 24} does not fit in the memory of cpu (' in err
    assert err.endswith('); lower the batch size (-b) or the input size (--img-size / --input-size)\n')


def test_a_datasets_classes_are_matched_by_name_with_those_saved_with_the_weights(vit, tmp_path, capsys):
    """--dataset labels its classes in its own order (torchvision's ImageFolder: sorted names, of the folders it
    has); a model whose saved classes are those names in another order is scored by name (100% for a model right on
    every image), and one without some of them is refused with both lists."""
    export, names, predicted, data = _export_with_shuffled_class_names(vit, tmp_path)
    args = ['--checkpoint', export, '--img-size', '32', '--dataset', 'torch/image_folder', '--data-dir', str(data)]
    (result,) = run_validate(args, tmp_path, capsys)['results']
    assert (result['count'], result['top1'], result['num_classes']) == (24, 100.0, 10)
    present = sorted(names[index] for index in set(predicted))
    os.rename(data / present[0], data / 'kind_x')
    err = _fails(args, capsys)
    assert "--dataset torch/image_folder: its classes are not among those saved with the model's weights" in err
    assert f"(kind_x). Its classes: {', '.join(sorted([*present[1:], 'kind_x']))}; the model's: " \
           f"{', '.join(sorted(names))}. Score it" in err


def test_a_torchvision_dataset_is_written_into_a_data_folder_only_when_asked_to_download(tmp_path, capsys):
    """Without --dataset-download, a missing or empty --data-dir is an error naming the option, and stays as it
    was; with it, Fashion-MNIST is unpacked there (from the Debian package when installed)."""
    from lipsformer.data import DEBIAN_FASHION_MNIST
    from lipsformer.evaluation.dataset_passes import DataRequest, plan_datasets
    missing, empty = tmp_path / 'missing', tmp_path / 'empty'
    os.makedirs(empty)
    base = ['--model', 'test_vit', '--num-classes', '10', '--img-size', '32', '--dataset', 'torch/fashion_mnist',
            '--split', 'test']
    err = _fails([*base, '--data-dir', str(missing)], capsys)
    assert f"Fashion-MNIST is not in the data folder: {str(missing)!r} does not exist" in err
    assert 'Nothing is written into a data folder unasked: --dataset-download' in err
    assert not missing.exists()
    err = _fails([*base, '--data-dir', str(empty)], capsys)
    assert 'FashionMNIST' in err and 'lacks train-images-idx3-ubyte' in err and os.listdir(empty) == []
    if os.path.isdir(DEBIAN_FASHION_MNIST):
        (planned,) = plan_datasets(DataRequest(str(missing), dataset='torch/fashion_mnist', split='test',
                                               download=True))
        assert len(planned.images.paths) == 10_000 and planned.images.num_classes == 10
        assert sorted(os.listdir(missing / 'FashionMNIST' / 'raw'))[0] == 't10k-images-idx3-ubyte'
