"""python -m lipsformer.hub.convert: weights of any layout into a timm folder that local-dir: loads with equal
logits."""
import json
import os

import pytest
import timm
import torch
from storage_faults import full_disk
from tiny_models import SMALLEST_MODEL, SMALLEST_SWIN

from lipsformer.hub.convert import ConversionError, authors_model_config, convert
from lipsformer.hub.convert import main as convert_main
from lipsformer.utils.io import save_safetensors
from lipsformer.weights.weight_files import load_file

pytestmark = pytest.mark.usefixtures('one_thread')

AUTHORS = os.path.join(os.path.dirname(__file__), 'fixtures', 'authors')
AUTHORS_FILE = os.path.join(AUTHORS, 'authors_checkpoint_swin_small.pth')


def _local_dir(folder) -> torch.nn.Module:
    return timm.create_model(f'local-dir:{folder}', pretrained=True).eval()


def test_authors_checkpoint_to_local_dir_reproduces_their_logits(tmp_path, capsys):
    out = tmp_path / 'swin'
    assert convert_main([AUTHORS_FILE, str(out)]) == 0
    assert 'max |difference| 0)' in capsys.readouterr().out
    assert sorted(os.listdir(out)) == ['config.json', 'model.safetensors']
    config = json.loads((out / 'config.json').read_text())
    # The architecture came from the file's yacs config: MODEL.SWIN.*, MODEL.NUM_CLASSES, DATA.IMG_SIZE.
    assert config['architecture'] == 'lipsformer_swin_tiny' and config['num_classes'] == 10
    assert {k: config['model_args'][k] for k in ('embed_dim', 'depths', 'num_heads', 'window_size', 'img_size')} == \
        dict(embed_dim=12, depths=[1, 1, 2, 1], num_heads=[1, 2, 3, 6], window_size=4, img_size=[64, 64])
    assert config['pretrained_cfg']['interpolation'] == 'bicubic' and config['pretrained_cfg']['crop_pct'] == 0.875
    assert 'label_names' not in config  # a 10-class file: the classes are unknown
    reference = torch.load(os.path.join(AUTHORS, 'swin_small.pt'), weights_only=True)
    with torch.no_grad():
        logits = _local_dir(out)(reference['input'])
    # The authors' own model's logits on the same weights (our implementation matches theirs to float rounding).
    torch.testing.assert_close(logits, reference['logits'], rtol=1e-5, atol=1e-5)
    # And the saved tensors are the file's, bit for bit (relative_position_index is rebuilt, not stored).
    saved = load_file(out / 'model.safetensors')
    authors = load_file(AUTHORS_FILE)['model']
    assert torch.equal(saved['head.fc.weight'], authors['head.weight'])


def test_model_flag_names_an_authors_file_whose_config_lacks_the_type(tmp_path, capsys):
    """--model is read before the config: MODEL.TYPE is not needed when it is given (MODEL.SWIN still applies)."""
    checkpoint = load_file(AUTHORS_FILE)
    del checkpoint['config']['MODEL']['TYPE']
    untyped = str(tmp_path / 'untyped.pth')
    torch.save(checkpoint, untyped)
    assert convert_main([untyped, str(tmp_path / 'refused')]) == 2
    assert 'Give --model to name the architecture' in capsys.readouterr().err
    assert convert_main([untyped, str(tmp_path / 'out'), '--model', 'lipsformer_swin_tiny']) == 0
    reference = torch.load(os.path.join(AUTHORS, 'swin_small.pt'), weights_only=True)
    with torch.no_grad():
        torch.testing.assert_close(_local_dir(tmp_path / 'out')(reference['input']), reference['logits'], rtol=1e-5,
                                   atol=1e-5)


def test_authors_config_picks_the_registered_variant():
    def config(embed_dim, depths, heads, classes=1000, dataset='imagenet'):
        swin = dict(PATCH_SIZE=4, IN_CHANS=3, EMBED_DIM=embed_dim, DEPTHS=depths, NUM_HEADS=heads, WINDOW_SIZE=7,
                    MLP_RATIO=4.0, QKV_BIAS=True)
        return dict(MODEL=dict(TYPE='swin', NUM_CLASSES=classes, SWIN=swin),
                    DATA=dict(IMG_SIZE=224, INTERPOLATION='bicubic', DATASET=dataset), TEST=dict(CROP=True))
    name, kwargs, data, labels = authors_model_config(config(96, [2, 2, 6, 2], [3, 6, 12, 24]))
    assert name == 'lipsformer_swin_tiny' and kwargs['num_classes'] == 1000 and data['input_size'] == (3, 224, 224)
    assert len(labels) == 1000 and labels[0] == 'n01440764'  # ImageNet-1k synsets, in class-index order
    assert authors_model_config(config(96, [2, 2, 18, 2], [3, 6, 12, 24]))[0] == 'lipsformer_swin_small'
    assert authors_model_config(config(128, [2, 2, 18, 2], [4, 8, 16, 32]))[0] == 'lipsformer_swin_base'
    # Their very first Tiny (depths 2,2,5,2) is no registered variant: built from the family with every argument.
    name, kwargs, _, _ = authors_model_config(config(96, [2, 2, 5, 2], [3, 6, 12, 24], classes=100, dataset='cifar'))
    assert name == 'lipsformer_swin_tiny' and kwargs['depths'] == (2, 2, 5, 2)
    assert authors_model_config(config(96, [2, 2, 5, 2], [3, 6, 12, 24], classes=100))[3] is None
    with pytest.raises(ConversionError, match="MODEL.TYPE 'swin_mlp'"):
        authors_model_config(dict(MODEL=dict(TYPE='swin_mlp'), DATA={}))


@pytest.fixture()
def tiny_file(tmp_path):
    model = timm.create_model(SMALLEST_MODEL, num_classes=3, **SMALLEST_SWIN).eval()
    path = str(tmp_path / 'weights.safetensors')
    save_safetensors(model.state_dict(), path)
    return model, path


def test_weights_file_with_model_name(tiny_file, tmp_path):
    model, path = tiny_file
    kwargs = dict(SMALLEST_SWIN, num_classes=3)
    result = convert(path, str(tmp_path / 'out'), SMALLEST_MODEL, kwargs)
    assert result['max_abs_logit_difference'] == 0.0 and result['num_classes'] == 3
    inputs = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        assert torch.equal(_local_dir(tmp_path / 'out')(inputs), model(inputs))
    with pytest.raises(ConversionError, match='--model is required'):
        convert(path, str(tmp_path / 'other'))


def test_output_folder_is_never_overwritten_by_accident(tiny_file, tmp_path, capsys):
    _, path = tiny_file
    args = [path, str(tmp_path / 'out'), '--model', SMALLEST_MODEL, '--model-kwargs', 'num_classes=3',
            'embed_dim=16', 'depths=[1,1,1,1]', 'num_heads=[1,1,1,1]', 'window_size=4', 'img_size=32']
    assert convert_main(args) == 0
    first = (tmp_path / 'out' / 'model.safetensors').read_bytes()
    assert convert_main(args) == 2 and 'is not empty' in capsys.readouterr().err
    assert convert_main([*args, '--force']) == 0  # a model folder may be replaced on request
    assert (tmp_path / 'out' / 'model.safetensors').read_bytes() == first
    (tmp_path / 'notes').mkdir()
    (tmp_path / 'notes' / 'todo.txt').write_text('keep me')
    assert convert_main([path, str(tmp_path / 'notes'), '--force']) == 2
    assert 'replaces model folders only' in capsys.readouterr().err
    assert (tmp_path / 'notes' / 'todo.txt').read_text() == 'keep me'
    assert convert_main([path, str(tmp_path), '--force']) == 2  # the source is inside: never deleted
    assert os.path.isfile(path)
    assert not [n for n in os.listdir(tmp_path) if n.startswith('.')]  # no temporary folder left


def test_file_overlay_trap_and_the_right_ways(tiny_file, tmp_path):
    """README: pretrained_cfg_overlay=dict(file=...) with num_classes other than the cfg's 1000 silently drops the
    head; local-dir: (or num_classes inside the overlay) loads it."""
    model, path = tiny_file
    convert(path, str(tmp_path / 'out'), SMALLEST_MODEL, dict(SMALLEST_SWIN, num_classes=3))
    inputs = torch.randn(2, 3, 32, 32)
    with torch.no_grad():
        expected = model(inputs)
        trap = timm.create_model(SMALLEST_MODEL, pretrained=True, num_classes=3, pretrained_cfg_overlay=dict(
            file=str(tmp_path / 'out' / 'model.safetensors')), **SMALLEST_SWIN).eval()
        assert not torch.equal(trap.head.fc.weight, model.head.fc.weight)  # a random head, and no error
        assert torch.equal(trap.stages[0].blocks[0].attn.qkv.weight, model.stages[0].blocks[0].attn.qkv.weight)
        overlay = timm.create_model(SMALLEST_MODEL, pretrained=True, num_classes=3, pretrained_cfg_overlay=dict(
            file=path, num_classes=3), **SMALLEST_SWIN).eval()
        assert torch.equal(overlay(inputs), expected)
        assert torch.equal(_local_dir(tmp_path / 'out')(inputs), expected)


def test_an_unusable_output_or_a_misspelt_argument_is_a_one_line_error(tiny_file, tmp_path, capsys):
    """An output below a file, and a constructor argument the model lacks, end with exit 2 and one line (the
    argument with the one it most likely meant), before anything is written."""
    _, path = tiny_file
    (tmp_path / 'file').write_text('not a folder')
    kwargs = ['--model-kwargs', 'num_classes=3', 'embed_dim=16', 'depths=[1,1,1,1]', 'num_heads=[1,1,1,1]',
              'window_size=4']
    assert convert_main([path, str(tmp_path / 'file' / 'sub' / 'out'), '--model', SMALLEST_MODEL, *kwargs,
                         'img_size=32']) == 2
    err = capsys.readouterr().err
    prog = 'python -m lipsformer.hub.convert'
    assert err == f"{prog}: error: {str(tmp_path / 'file' / 'sub' / 'out')!r} cannot be written: " \
                  f"{str(tmp_path / 'file')!r} is a file, not a folder; give another folder\n"
    assert convert_main([path, str(tmp_path / 'out'), '--model', SMALLEST_MODEL, *kwargs, 'imgsize=32']) == 2
    assert capsys.readouterr().err == f'{prog}: error: --model-kwargs: the model takes no imgsize; did you mean ' \
                                      f'img_size?\n'
    assert convert_main([path, str(tmp_path / 'out'), '--model', SMALLEST_MODEL, *kwargs, 'img_size=50']) == 2
    assert 'img_size must be a multiple of 32, got 50x50' in capsys.readouterr().err
    assert sorted(os.listdir(tmp_path)) == ['file', 'weights.safetensors']


def test_a_full_disk_is_one_line_and_status_4_with_nothing_left(tiny_file, tmp_path, capsys):
    """OUT_DIR on a tmpfs smaller than the weights: exit 4 and one line, as validate.py and lipsformer-lipschitz end
    on a failed write, and neither the folder nor a temporary one is left on that disk."""
    _, path = tiny_file
    size_kib = max(os.path.getsize(path) // 2048, 8)
    with full_disk(str(tmp_path / 'small'), f'{size_kib}k') as small:
        out = os.path.join(small, 'out')
        assert convert_main([path, out, '--model', SMALLEST_MODEL, '--model-kwargs', 'num_classes=3', 'embed_dim=16',
                             'depths=[1,1,1,1]', 'num_heads=[1,1,1,1]', 'window_size=4', 'img_size=32']) == 4
        assert os.listdir(small) == []
    assert capsys.readouterr().err == (
        f'python -m lipsformer.hub.convert: error: {out} could not be written: No space left on device; nothing was '
        f'written there (free space there, or give another OUT_DIR)\n')
