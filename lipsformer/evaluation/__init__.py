"""Evaluation on ImageNet val, ImageNet-ReaL and ImageNet-V2 (the paper's Table 8), behind validate.py.

- :mod:`.layouts`: image lists and labels of each data set layout, checked before scoring;
- :mod:`.real`: ReaL label sets matched by file name, so any subset of val can be scored;
- :mod:`.checkpoints`: which weights a ``--checkpoint`` means and the model that fits them (model names themselves are
  resolved by :mod:`lipsformer.weights.model_names`, as in every command);
- :mod:`.predict` / :mod:`.metrics` / :mod:`.dataset_passes`: predictions in data set order on one or many processes,
  and their scores on each requested data set;
- :mod:`.records`: the table, JSON and CSV; :mod:`.validate_command`: the command line.
"""
from ..weights.model_names import expand_model_names
from .checkpoints import ResolvedCheckpoint, SavedModelConfig, create_eval_model, resolve_checkpoint
from .dataset_passes import DataRequest, DatasetResult, evaluate, plan_datasets
from .errors import EvaluationError
from .layouts import ImageList, imagenet_synsets, list_image_folder, list_imagenet_v2, list_imagenet_val
from .metrics import Score, score_label_sets, score_labels
from .predict import InferenceSettings, Predictions, predict
from .real import load_real_labels, real_labels_for

__all__ = [
    'DataRequest', 'DatasetResult', 'EvaluationError', 'ImageList', 'InferenceSettings', 'Predictions',
    'ResolvedCheckpoint', 'SavedModelConfig', 'Score', 'create_eval_model', 'evaluate', 'expand_model_names',
    'imagenet_synsets', 'list_image_folder', 'list_imagenet_v2', 'list_imagenet_val', 'load_real_labels',
    'plan_datasets', 'predict', 'real_labels_for', 'resolve_checkpoint', 'score_label_sets', 'score_labels',
]
