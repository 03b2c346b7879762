"""Unit tests of lipsformer.evaluation: layouts and label mapping, ReaL matching and scoring, checkpoint resolution."""
import json
import os

import pytest
import safetensors.torch
import timm
import torch
from imagenet_trees import build_tree, val_file_name, write_jpegs
from training_support import write_checkpoint_meta

from lipsformer.evaluation import (
    EvaluationError,
    ResolvedCheckpoint,
    expand_model_names,
    imagenet_synsets,
    list_image_folder,
    list_imagenet_v2,
    list_imagenet_val,
    load_real_labels,
    real_labels_for,
    resolve_checkpoint,
    score_label_sets,
    score_labels,
)
from lipsformer.evaluation.records import write_results
from lipsformer.training import load_config
from lipsformer.training.config_io import dump_config
from lipsformer.weights.model_names import UnknownModelError


@pytest.fixture(scope='module')
def photos(tmp_path_factory):
    """Six real JPEGs with official val names."""
    return write_jpegs(str(tmp_path_factory.mktemp('photos')), [val_file_name(i) for i in range(1, 7)])


def test_synset_order_is_sorted_and_complete():
    synsets = imagenet_synsets()
    assert len(synsets) == 1000 and synsets == sorted(synsets)
    assert synsets[0] == 'n01440764' and synsets[-1] == 'n15075141'  # tench, toilet tissue


def test_val_layout_maps_synsets_to_sorted_index(tmp_path, photos):
    placements = {photos[0]: 0, photos[1]: 417, photos[2]: 999}
    images = list_imagenet_val(build_tree(str(tmp_path / 'val'), placements))
    assert images.layout == 'synset' and images.num_classes == 1000
    assert [os.path.basename(p) for p in images.paths] == [os.path.basename(p) for p in photos[:3]]
    assert images.targets == [0, 417, 999]
    assert os.path.basename(os.path.dirname(images.paths[1])) == imagenet_synsets()[417]


def test_v2_numeric_folders_map_by_integer_not_string_sort(tmp_path, photos):
    # Folders 2, 10, 100 and 999: a string sort of 0..999 puts them at 112, 2, 3 and 999.
    classes = [2, 10, 100, 999]
    root = build_tree(str(tmp_path / 'v2'), dict(zip(photos, classes)), layout='numeric')
    images = list_imagenet_v2(root)
    assert images.layout == 'v2-numeric'
    assert images.targets == classes
    string_sorted = sorted(str(i) for i in range(1000))
    assert [string_sorted.index(str(c)) for c in classes] == [112, 2, 3, 999]  # the trap this test guards
    assert [int(os.path.basename(os.path.dirname(p))) for p in images.paths] == classes


def test_v2_synset_layout_is_read_like_val(tmp_path, photos):
    images = list_imagenet_v2(build_tree(str(tmp_path / 'v2'), {photos[0]: 5, photos[1]: 500}))
    assert images.layout == 'synset' and images.targets == [5, 500]


def test_missing_folder_is_an_error(tmp_path):
    with pytest.raises(EvaluationError, match='does not exist'):
        list_imagenet_val(tmp_path / 'nowhere')
    with pytest.raises(EvaluationError, match='does not exist'):
        list_imagenet_v2(tmp_path / 'nowhere')


def test_empty_folders_are_errors(tmp_path):
    with pytest.raises(EvaluationError, match='no class sub-folders'):
        list_imagenet_val(tmp_path)
    with pytest.raises(EvaluationError, match='no class sub-folders'):
        list_imagenet_v2(tmp_path)
    with pytest.raises(EvaluationError, match='no images'):
        list_imagenet_val(build_tree(str(tmp_path / 'val'), {}))
    with pytest.raises(EvaluationError, match='no images'):
        list_imagenet_v2(build_tree(str(tmp_path / 'v2'), {}, layout='numeric'))


def test_devkit_numeric_ids_are_rejected(tmp_path):
    for i in range(1, 1001):
        os.makedirs(tmp_path / str(i))
    with pytest.raises(EvaluationError, match='devkit'):
        list_imagenet_val(tmp_path)
    with pytest.raises(EvaluationError, match='0..999'):
        list_imagenet_v2(tmp_path)


def test_v2_layout_passed_as_val_points_to_v2_dir(tmp_path, photos):
    root = build_tree(str(tmp_path / 'v2'), {photos[0]: 3}, layout='numeric')
    with pytest.raises(EvaluationError, match='--v2-dir'):
        list_imagenet_val(root)


def test_a_subset_of_the_synsets_is_labelled_by_name_and_unknown_folders_are_rejected(tmp_path, photos):
    synsets = imagenet_synsets()
    chosen = [0, 217, 482, 491, 497, 566, 569, 571, 574, 701]  # Imagenette's ten classes
    images = list_imagenet_val(build_tree(str(tmp_path / 'val'), dict(zip(photos, chosen[:6])), subset=True))
    assert images.targets == chosen[:6] and (images.classes_present, images.num_classes) == (6, 1000)
    assert sorted(os.listdir(tmp_path / 'val')) == [synsets[i] for i in chosen[:6]]
    os.makedirs(tmp_path / 'val' / 'not_a_synset')
    with pytest.raises(EvaluationError, match='1 of its 7 class folders are not ImageNet-1k synsets: not_a_synset'):
        list_imagenet_val(tmp_path / 'val')
    v2 = list_imagenet_v2(build_tree(str(tmp_path / 'v2'), dict(zip(photos, chosen[:6])), layout='numeric',
                                     subset=True))
    assert v2.targets == chosen[:6] and v2.classes_present == 6
    os.makedirs(tmp_path / 'v2' / '0042')
    with pytest.raises(EvaluationError, match='not class indices: 0042'):
        list_imagenet_v2(tmp_path / 'v2')


def test_loose_images_are_rejected(tmp_path, photos):
    os.link(photos[0], tmp_path / os.path.basename(photos[0]))
    with pytest.raises(EvaluationError, match='directly inside'):
        list_imagenet_val(tmp_path)


def test_image_folder_uses_natural_class_order(tmp_path, photos):
    for name, photo in zip(['class10', 'class2', 'class1'], photos):
        os.makedirs(tmp_path / name)
        os.link(photo, tmp_path / name / os.path.basename(photo))
    images = list_image_folder(tmp_path)
    assert images.num_classes == 3
    by_folder = {os.path.basename(os.path.dirname(p)): t for p, t in zip(images.paths, images.targets)}
    assert by_folder == {'class1': 0, 'class2': 1, 'class10': 2}


def test_bundled_real_labels_match_official_names():
    labels = load_real_labels()
    assert len(labels) == 50_000
    assert labels[val_file_name(1)] == [] and labels[val_file_name(2)] == [970, 795]


def test_real_label_file_formats_and_errors(tmp_path):
    as_dict = tmp_path / 'real.json'
    as_dict.write_text(json.dumps({val_file_name(7): [3, 4], 'renamed.jpg': []}))
    assert load_real_labels(as_dict) == {val_file_name(7): [3, 4], 'renamed.jpg': []}
    short_list = tmp_path / 'short.json'
    short_list.write_text(json.dumps([[1], [2]]))
    with pytest.raises(EvaluationError, match='2 entries'):
        load_real_labels(short_list)
    bad_label = tmp_path / 'bad.json'
    bad_label.write_text(json.dumps({val_file_name(1): [1000]}))
    with pytest.raises(EvaluationError, match='0..999'):
        load_real_labels(bad_label)
    with pytest.raises(EvaluationError, match='cannot read'):
        load_real_labels(tmp_path / 'missing.json')


def test_real_labels_need_official_file_names():
    labels = load_real_labels()
    assert real_labels_for(['/x/' + val_file_name(3)], labels) == [[230, 231]]
    with pytest.raises(EvaluationError, match='1 of 2 images have no ReaL labels.*ILSVRC2012_val_%08d.JPEG'):
        real_labels_for(['/x/' + val_file_name(3), '/x/tench_001.jpg'], labels)


def test_label_scores_count_exactly():
    topk = torch.tensor([[1, 2, 3], [4, 5, 6], [7, 8, 9], [1, 1, 1]])
    targets = torch.tensor([1, 6, 0, 1])
    readable = torch.tensor([True, True, True, False])
    score = score_labels(topk, targets, readable)
    assert (score.count, score.correct_top1, score.correct_topk) == (3, 1, 2)
    assert score.top1 == 100 / 3 and score.topk == 200 / 3


def test_real_scores_leave_out_empty_label_sets_and_unreadable_images():
    topk = torch.tensor([[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]])
    label_sets = [[1], [], [6, 50], [7], [9]]
    readable = torch.tensor([True, True, True, True, False])
    score = score_label_sets(topk, label_sets, readable)
    # counted: images 0, 2, 3; top-1 right: 0 and 3; top-2 right: 0, 2 and 3
    assert (score.count, score.correct_top1, score.correct_topk) == (3, 2, 3)
    assert score.top1 == 200 / 3 and score.topk == 100.0
    assert score_label_sets(topk[:2], [[], []], readable[:2]).top1 is None


def _save(model: torch.nn.Module, path) -> str:
    os.makedirs(os.path.dirname(path), exist_ok=True)
    safetensors.torch.save_file(model.state_dict(), str(path))
    return str(path)


def test_run_folder_prefers_export_best_then_last_then_newest_checkpoint(tmp_path):
    model = timm.create_model('test_vit')
    new = _save(model, tmp_path / 'checkpoints' / 'epoch_10' / 'model.safetensors')
    write_checkpoint_meta(tmp_path / 'checkpoints' / 'epoch_10', step=100)
    _save(model, tmp_path / 'checkpoints' / 'epoch_2' / 'model.safetensors')  # written last, but less advanced
    write_checkpoint_meta(tmp_path / 'checkpoints' / 'epoch_2', step=20)
    _save(model, tmp_path / 'checkpoints' / '.tmp-epoch_11' / 'model.safetensors')  # a save in progress
    assert resolve_checkpoint(tmp_path).weights == new  # the one training would resume from
    last = _save(model, tmp_path / 'export' / 'last' / 'model.safetensors')
    assert resolve_checkpoint(tmp_path).weights == last
    best = _save(model, tmp_path / 'export' / 'best' / 'model.safetensors')
    assert resolve_checkpoint(tmp_path).weights == best
    with pytest.raises(EvaluationError, match='holds no weights'):
        resolve_checkpoint(tmp_path / 'checkpoints')


def test_ema_weights_of_a_folder_an_export_file_and_a_torch_file(tmp_path):
    model = timm.create_model('test_vit')
    best = _save(model, tmp_path / 'export' / 'best' / 'model.safetensors')
    with pytest.raises(EvaluationError, match='no EMA weights'):
        resolve_checkpoint(tmp_path, use_ema=True)
    best_ema = _save(model, tmp_path / 'export' / 'best' / 'model_ema.safetensors')
    assert resolve_checkpoint(tmp_path, use_ema=True).weights == best_ema
    assert resolve_checkpoint(best, use_ema=True).weights == best_ema  # the EMA twin of an export file
    assert not resolve_checkpoint(best_ema, use_ema=True).ema_entry  # the EMA file itself holds plain weights
    torch_file = tmp_path / 'last.pth.tar'
    torch.save({'state_dict': model.state_dict(), 'state_dict_ema': model.state_dict()}, torch_file)
    assert resolve_checkpoint(torch_file, use_ema=True) == ResolvedCheckpoint(str(torch_file), True, None)


def _run_with_config(run_dir, *overrides: str) -> None:
    """A run folder as train.py leaves it: its resolved config.yaml and one checkpoint."""
    dump_config(load_config(None, ['model.name=test_vit', *overrides]), run_dir / 'config.yaml')
    _save(timm.create_model('test_vit'), run_dir / 'checkpoints' / 'step_5' / 'model.safetensors')
    write_checkpoint_meta(run_dir / 'checkpoints' / 'step_5', step=5)


def test_run_config_yaml_describes_the_model(tmp_path):
    _run_with_config(tmp_path, 'model.kwargs={depth: 2}', 'model.img_size=64', 'model.num_classes=10',
                     'data.mean=[0.2, 0.2, 0.2]', 'data.crop_pct=1.0')
    saved = resolve_checkpoint(tmp_path).model_config
    assert saved.name == 'test_vit'
    assert saved.kwargs == {'depth': 2, 'img_size': 64, 'in_chans': 3, 'num_classes': 10}
    assert saved.cfg_overlay == {'mean': [0.2, 0.2, 0.2], 'interpolation': 'bicubic', 'crop_pct': 1.0,
                                 'input_size': (3, 64, 64)}


def test_run_config_is_read_as_training_reads_it(tmp_path):
    _run_with_config(tmp_path, 'data.interpolation=random')
    assert resolve_checkpoint(tmp_path).model_config.cfg_overlay == {'interpolation': 'bicubic'}  # as evaluated
    (tmp_path / 'config.yaml').write_text('model: {name: test_vit, img_size: -3}\n')
    with pytest.raises(EvaluationError, match='model.img_size: got -3; allowed: null or an integer >= 1'):
        resolve_checkpoint(tmp_path)


def test_model_names_from_lists_and_wildcards():
    assert expand_model_names('test_vit, resnet10t') == ['test_vit', 'resnet10t']
    assert set(expand_model_names('test_vit*')) == set(timm.list_models('test_vit*')) >= {'test_vit', 'test_vit2'}
    assert set(expand_model_names('test_vit*', with_weights=True)) == {
        'test_vit.r160_in1k', 'test_vit2.r160_in1k', 'test_vit3.r160_in1k'}
    with pytest.raises(UnknownModelError, match="no timm model matches 'no_such_model'"):
        expand_model_names('no_such_model')
    with pytest.raises(UnknownModelError, match="no timm model matches 'no_such_.'"):
        expand_model_names('no_such_*')
    with pytest.raises(UnknownModelError, match='none with pretrained weights'):
        expand_model_names('lipsformer_cswin_*', with_weights=True)


def test_results_file_replaced_atomically(tmp_path):
    path = tmp_path / 'out' / 'results.json'
    record = {'model': 'm', 'checkpoint': None, 'settings': {}, 'versions': {}, 'results': []}
    write_results(path, [record])
    assert json.loads(path.read_text()) == record
    write_results(path, [record, record])
    assert json.loads(path.read_text()) == [record, record]
    assert os.listdir(path.parent) == ['results.json']  # no temporary file left behind


def test_files_beside_the_class_folders_are_named_as_skipped(tmp_path, photos):
    """A file next to the class folders (a README, a label file, a link that points nowhere) is not read: it is one
    of the layout's files left out, as a file of another type inside a class folder is."""
    for name, photo in zip(['class1', 'class2'], photos):
        os.makedirs(tmp_path / name)
        os.link(photo, tmp_path / name / os.path.basename(photo))
    (tmp_path / 'README.txt').write_text('labels come from the folder names')
    (tmp_path / 'class2' / 'notes.txt').write_text('not an image')
    os.symlink(tmp_path / 'nowhere.csv', tmp_path / 'labels.csv')
    (tmp_path / '.DS_Store').write_bytes(b'')
    images = list_image_folder(tmp_path)
    assert len(images.paths) == 2
    assert images.left_out == tuple(str(tmp_path / name) for name in ('class2/notes.txt', 'labels.csv', 'README.txt'))
