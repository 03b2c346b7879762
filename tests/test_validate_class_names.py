"""validate.py --dataset torch/fashion_mnist for a model trained on an image folder of the same data: the class names
saved with the weights are compared with torchvision's; the same names in another order are scored by name, other
names are refused with both lists."""
import os

import pytest
from torchvision.datasets import FashionMNIST

from lipsformer.data import DEBIAN_FASHION_MNIST
from lipsformer.evaluation.dataset_passes import DataRequest, plan_datasets
from lipsformer.evaluation.errors import EvaluationError

pytestmark = pytest.mark.skipif(not os.path.isdir(DEBIAN_FASHION_MNIST),
                                reason='needs the Debian package dataset-fashion-mnist')


@pytest.fixture(scope='module')
def fashion_mnist(tmp_path_factory) -> str:
    data_dir = str(tmp_path_factory.mktemp('fashion_mnist'))
    plan_datasets(DataRequest(data_dir, dataset='torch/fashion_mnist', split='test', download=True))
    return data_dir


def test_the_same_classes_in_another_order_are_scored_by_name(fashion_mnist):
    """An image folder's classes are its sorted folder names: each test image is labelled with its class's index
    among them, not with torchvision's index of it."""
    torchvision_names = FashionMNIST.classes
    folder_order = sorted(torchvision_names)
    assert folder_order != torchvision_names
    (planned,) = plan_datasets(DataRequest(fashion_mnist, dataset='torch/fashion_mnist', split='test',
                                           class_names=folder_order))
    reference = FashionMNIST(fashion_mnist, train=False)
    assert planned.images.num_classes == 10 and len(planned.images.paths) == len(reference) == 10_000
    for index in (0, 1, 2, 3, 9_999):
        assert planned.images.source[index][1] == folder_order.index(torchvision_names[int(reference.targets[index])])


def test_other_class_names_are_refused_with_both_lists(fashion_mnist):
    """A folder cannot be named 'T-shirt/top': the image folder's class is 'T-shirt_top', which torchvision's
    Fashion-MNIST does not have."""
    folder_names = sorted(name.replace('/', '_') for name in FashionMNIST.classes)
    with pytest.raises(EvaluationError) as refused:
        plan_datasets(DataRequest(fashion_mnist, dataset='torch/fashion_mnist', split='test', class_names=folder_names))
    message = str(refused.value)
    assert "its classes are not among those saved with the model's weights" in message
    both = ('Its classes: Ankle boot, Bag, Coat, Dress, Pullover, Sandal, Shirt, Sneaker, T-shirt/top, Trouser; '
            "the model's: Ankle boot, Bag, Coat, Dress, Pullover, Sandal, Shirt, Sneaker, T-shirt_top, Trouser")
    assert both in message
