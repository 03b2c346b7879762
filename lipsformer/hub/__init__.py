"""Where timm users keep models: the Hugging Face Hub and timm model folders.

- :mod:`.model_names`: ``hf-hub:REPO_ID`` and ``local-dir:FOLDER`` names, accepted wherever a model name is
  (train.py, validate.py, the Lipschitz and benchmark commands);
- :mod:`.model_folder`: a timm model folder (``config.json`` + ``model.safetensors``) that timm's ``local-dir:`` and
  transformers' ``AutoModelForImageClassification`` both load (every export and conversion is written by it);
- :mod:`.model_card`: the model card (README.md with Hub metadata) of an export (``python -m lipsformer.hub card``);
- :mod:`.upload`: an export with its card to the Hub (``python -m lipsformer.hub push``).

``python -m lipsformer.convert`` makes a timm model folder from the authors' checkpoints and any other weights.
"""
from .model_card import CardError, find_export, write_card
from .model_folder import save_model_folder
from .model_names import ModelSourceError, check_model_source, create_model, model_source

__all__ = ['CardError', 'ModelSourceError', 'check_model_source', 'create_model', 'find_export', 'model_source',
           'save_model_folder', 'write_card']
