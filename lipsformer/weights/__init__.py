"""Weights in and out: the files, the names that carry them and the model folders that hold them.

- :mod:`.file_reading`: one weights file read without executing code from it (:func:`load_file`);
- :mod:`.pretrained_sources`: pretrained weights that cannot be had (a host out of reach, a missing or unreadable
  file) explained, for the commands and for ``timm.create_model(..., pretrained=True)`` (the models' builder loads
  pretrained weights inside :func:`~.pretrained_sources.explaining_pretrained_failures`, which ``import lipsformer``
  gives it); ``ModelSourceError``;
- :mod:`.weight_files`: weight files of any layout (timm, exports, the authors', training checkpoints), read without
  executing code from them and loaded into a model strictly;
- :mod:`.model_names`: ``hf-hub:REPO_ID``, ``local-dir:FOLDER`` and registered names, resolved the same way by every
  command, and what a model's constructor was given that it does not take;
- :mod:`.model_folder`: the timm model folders (``config.json`` + ``model.safetensors``) that exports and conversions
  write.

The models raise their own checkpoint errors (``lipsformer.models.CheckpointError``, the class
:mod:`.weight_files` raises too); this room stands on the models and :mod:`lipsformer.utils` alone. Conversion, which
reads training runs and evaluation's checkpoints, is a command of :mod:`lipsformer.hub`.
"""
