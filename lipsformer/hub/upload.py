"""Uploading an export with its card to the Hugging Face Hub: ``python -m lipsformer.hub push RUN_DIR|EXPORT REPO_ID``.

The export is already a timm model folder (``timm.models.save_for_hf``'s ``config.json`` + ``model.safetensors``),
so it goes up as it is, with the card and plots beside it, through the same ``huggingface_hub.HfApi`` calls that
``timm.models.push_to_hf_hub`` makes (``create_repo``, then ``upload_folder``, as library ``timm``). The token comes
from ``huggingface-cli login`` / ``HF_TOKEN`` unless one is given.
"""
import os
from typing import Any

import timm
from huggingface_hub import HfApi

from ..utils.io import read_json
from .model_card import CARD_FILE, find_export, write_card

__all__ = ['REQUIRED_FILES', 'export_files', 'push']

REQUIRED_FILES = ('config.json', 'model.safetensors', CARD_FILE)


def export_files(folder: str) -> list[str]:
    """The files of an export that are uploaded (relative paths; hidden and temporary files left out)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
        files += [os.path.relpath(os.path.join(root, n), folder) for n in sorted(names) if not n.startswith('.')]
    return files


def push(target: str, repo_id: str, private: bool = False, which: str = 'best', token: str | None = None,
         revision: str | None = None, commit_message: str | None = None, keep_card: bool = False,
         lipschitz: bool = True) -> Any:
    """Write the card (naming ``repo_id``) into the export ``target`` means and upload the export.

    Args:
        target: A training run folder or an export / model folder.
        repo_id: ``USER/REPO`` (created if missing).
        private: Create the repository private.
        which: The run's export to push: ``best`` or ``last``.
        token: Hub token; None for the logged-in one.
        revision: Branch to push to.
        commit_message: Default: one naming the model.
        keep_card: Upload an existing ``README.md`` as it is instead of rewriting it.
        lipschitz: Put the Lipschitz bounds in a rewritten card.

    Returns:
        What ``HfApi.upload_folder`` returns (the commit's info).
    """
    export = find_export(target, which)
    if not (keep_card and os.path.isfile(os.path.join(export.path, CARD_FILE))):
        write_card(export, repo_id, lipschitz=lipschitz)
    files = export_files(export.path)
    missing = [name for name in REQUIRED_FILES if name not in files]
    if missing:
        raise FileNotFoundError(f'{export.path!r} lacks {", ".join(missing)}; nothing was uploaded')
    api = HfApi(token=token, library_name='timm', library_version=timm.__version__)
    repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
    architecture = read_json(os.path.join(export.path, 'config.json'))['architecture']
    return api.upload_folder(repo_id=repo_url.repo_id, folder_path=export.path, allow_patterns=files,
                             revision=revision, commit_message=commit_message or f'Add {architecture} weights')
