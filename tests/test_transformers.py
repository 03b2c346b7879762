"""transformers loads the timm model folders this package writes: AutoModelForImageClassification and the
image-classification pipeline (TimmWrapper) on an export of each family give timm's ``local-dir:`` logits and
probabilities. transformers 5 builds the model on the meta device and loads the saved tensors into it; the Swin
relative-position index, never saved, is rebuilt by the model's init_non_persistent_buffers().

transformers is a dev extra (4.53 or later: the first TimmWrapper that builds a folder's architecture with its
model_args); the import alone takes seconds, so each family is one test."""
import numpy as np
import pytest
import timm
import torch
import transformers
from PIL import Image
from tiny_models import TINY_MODELS

from lipsformer.hub import write_card
from lipsformer.hub.convert import convert
from lipsformer.utils.io import read_json, save_safetensors
from lipsformer.weights.model_folder import save_model_folder

pytestmark = pytest.mark.usefixtures('one_thread')

CLASSES = ['t-shirt', 'trouser', 'pullover']
FAMILIES = ['lipsformer_swin_tiny', 'lipsformer_cswin_tiny']


def _image() -> Image.Image:
    pixels = np.random.default_rng(0).integers(0, 256, (80, 96, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


@pytest.mark.parametrize('name', FAMILIES)
def test_transformers_loads_an_export_as_timm_does(name, tmp_path):
    model = timm.create_model(name, num_classes=len(CLASSES), **TINY_MODELS[name]).eval()
    folder = str(tmp_path / 'export')
    save_model_folder(model, folder, model_config={'label_names': CLASSES})
    assert 'num_classes' not in read_json(f'{folder}/config.json')['model_args']  # transformers passes it itself
    reference = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()

    classifier = transformers.AutoModelForImageClassification.from_pretrained(folder).eval()
    assert [classifier.config.id2label[i] for i in range(len(CLASSES))] == CLASSES
    inputs = torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(classifier(inputs).logits, reference(inputs))

    # The pipeline preprocesses as timm's transform of the folder's pretrained cfg (64x64, bicubic, crop 0.875).
    predictions = transformers.pipeline('image-classification', model=folder)(_image(), top_k=len(CLASSES))
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(reference))
    with torch.no_grad():
        probabilities = reference(transform(_image()).unsqueeze(0)).softmax(-1)[0]
    expected = sorted(zip(CLASSES, probabilities.tolist()), key=lambda item: -item[1])
    assert [p['label'] for p in predictions] == [label for label, _ in expected]
    np.testing.assert_allclose([p['score'] for p in predictions], [score for _, score in expected], atol=1e-5)


def test_a_converted_folder_loads_in_transformers(tmp_path):
    """python -m lipsformer.hub.convert writes the same config.json (the training export goes through it as well)."""
    name = 'lipsformer_cswin_tiny'
    model = timm.create_model(name, num_classes=3, **TINY_MODELS[name]).eval()
    save_safetensors(model.state_dict(), str(tmp_path / 'weights.safetensors'))
    convert(str(tmp_path / 'weights.safetensors'), str(tmp_path / 'out'), name, dict(TINY_MODELS[name], num_classes=3))
    classifier = transformers.AutoModelForImageClassification.from_pretrained(str(tmp_path / 'out')).eval()
    inputs = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        torch.testing.assert_close(classifier(inputs).logits, model(inputs))


def test_a_one_channel_export_in_the_pipeline_as_its_card_says(tmp_path, monkeypatch):
    """The pipeline makes a path or a PIL image RGB, and the image processor of a timm folder has no setting that
    converts channels back: a 1-channel (Fashion-MNIST) export refuses that input, and the card says so and gives the
    input that works (an H x W x 1 array). The card's own code is run here, on the folder."""
    name = 'lipsformer_swin_tiny'
    model = timm.create_model(name, num_classes=len(CLASSES), in_chans=1, **TINY_MODELS[name]).eval()
    folder = str(tmp_path / 'export')
    save_model_folder(model, folder, model_config={'label_names': CLASSES})
    classifier = transformers.pipeline('image-classification', model=folder)
    with pytest.raises(ValueError, match='expected 1 input channels, got 3'):
        classifier(_image())  # if this passes one day, the card's and hub.md's words are out of date
    card = open(write_card(folder, lipschitz=False)).read()
    assert 'Give this one the image as an H x W x 1 array, which the pipeline of transformers 5 and later takes' in card
    if int(transformers.__version__.split('.')[0]) < 5:
        with pytest.raises(TypeError, match='Incorrect format used for image'):  # as the card says of 4.x
            classifier(np.asarray(_image().convert('L'))[..., None])
        pytest.skip(f'transformers {transformers.__version__}: its pipeline takes no arrays, the card\'s code needs 5')
    predictions = classifier(np.asarray(_image().convert('L'))[..., None], top_k=len(CLASSES))
    reference = timm.create_model(f'local-dir:{folder}', pretrained=True).eval()
    transform = timm.data.create_transform(**timm.data.resolve_model_data_config(reference))
    with torch.no_grad():
        probabilities = reference(transform(_image().convert('L')).unsqueeze(0)).softmax(-1)[0]
    assert {p['label']: round(p['score'], 5) for p in predictions} == \
        {label: round(score, 5) for label, score in zip(CLASSES, probabilities.tolist())}

    assert 'so on a path or a PIL image it needs a 3-channel model; this model takes 1, and fails there with ' \
           '"expected 1 input channels, got 3". Give this one the image as an H x W x 1 array' in card
    usage = card.split('## How to use')[1].split('## Citation')[0]
    code = '\n'.join(block.split('\n', 1)[1] for block in usage.split('```')[1::2])
    code = code.replace("'hf-hub:USER/REPO'", repr(f'local-dir:{folder}')).replace("'USER/REPO'", repr(folder))
    _image().save(tmp_path / 'image.jpg')
    monkeypatch.chdir(tmp_path)
    exec(compile(code, 'README.md', 'exec'), {})
