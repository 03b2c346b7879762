"""Publishing models: conversions to timm model folders, model cards and uploads to the Hugging Face Hub.

- :mod:`.convert`: the authors' checkpoints, training runs and any other weights as a timm model folder
  (``python -m lipsformer.hub.convert``);
- :mod:`.model_card`: the model card (README.md with Hub metadata) of an export (``python -m lipsformer.hub card``);
- :mod:`.upload`: an export with its card to the Hub (``python -m lipsformer.hub push``).

``hf-hub:REPO_ID`` and ``local-dir:FOLDER`` names are resolved by :mod:`lipsformer.weights.model_names` and timm model
folders written by :mod:`lipsformer.weights.model_folder`; both are re-exported here.
"""
from ..weights.model_folder import save_model_folder
from ..weights.model_names import ModelSourceError, check_model_source, create_model, model_source
from .model_card import CardError, find_export, write_card

__all__ = ['CardError', 'ModelSourceError', 'check_model_source', 'create_model', 'find_export', 'model_source',
           'save_model_folder', 'write_card']
