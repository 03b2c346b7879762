"""Uploading an export with its card to the Hugging Face Hub: ``python -m lipsformer.hub push RUN_DIR|EXPORT REPO_ID``.

The export is already a timm model folder (``config.json`` + ``model.safetensors``, as ``timm.models.save_for_hf``
writes it), so it goes up as it is, with the card and plots beside it, in one commit, as library ``timm`` (the
``HfApi`` calls ``timm.models.push_to_hf_hub`` makes: ``create_repo``, then the commit). The token comes from
``hf auth login`` / ``huggingface-cli login`` / ``HF_TOKEN`` unless one is given.

Nothing in the export changes before the upload has succeeded: the token and the Hub are checked first (one line
saying what is missing when there is no token, the token is refused or the Hub cannot be reached), the new card and
the run's plots are uploaded from memory and from the run folder, and only then written into the export.
"""
import io
import os
from typing import Any

import timm
from huggingface_hub import CommitOperationAdd, HfApi, get_token
from huggingface_hub import constants as hf_constants

from ..utils.io import read_json
from ..weights.model_names import unreachable
from .model_card import CARD_FILE, CardError, build_card, find_export, save_card

__all__ = ['HubAccessError', 'REQUIRED_FILES', 'check_access', 'export_files', 'push']

REQUIRED_FILES = ('config.json', 'model.safetensors', CARD_FILE)


class HubAccessError(CardError):
    """No token, a token the Hub refuses, or a Hub that cannot be reached: nothing was uploaded or changed."""


def export_files(folder: str) -> list[str]:
    """The files of an export that are uploaded (relative paths; hidden and temporary files left out)."""
    files = []
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not d.startswith('.'))
        files += [os.path.relpath(os.path.join(root, n), folder) for n in sorted(names) if not n.startswith('.')]
    return files


def check_access(api: HfApi, token: str | None) -> str:
    """The account a push would upload as; checks that there is a token and that the Hub accepts it.

    Raises:
        HubAccessError: No token, a refused token, or no connection to the Hub (``HF_ENDPOINT``).
    """
    token = token or get_token()
    if not token:
        raise HubAccessError('no Hugging Face token: log in with `hf auth login` (or `huggingface-cli login`), set '
                             'HF_TOKEN, or pass --token; nothing was uploaded and the export is unchanged')
    try:
        return api.whoami(token=token)['name']
    except Exception as e:  # noqa: BLE001  requests / httpx / huggingface_hub errors, by library version
        reason = _first_line(e)
        if unreachable(e):
            raise HubAccessError(f'cannot reach the Hugging Face Hub at {hf_constants.ENDPOINT} ({reason}); nothing '
                                 f'was uploaded and the export is unchanged: push again once online') from None
        raise HubAccessError(f'the Hugging Face Hub at {hf_constants.ENDPOINT} refused the token ({reason}); nothing '
                             f'was uploaded and the export is unchanged: log in again or pass another '
                             f'--token') from None


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0][:200] if text else type(error).__name__


def push(target: str, repo_id: str, private: bool = False, which: str = 'best', token: str | None = None,
         revision: str | None = None, commit_message: str | None = None, keep_card: bool = False,
         lipschitz: bool = True, results: tuple[str, ...] = ()) -> Any:
    """Upload the export ``target`` means with a card naming ``repo_id``, then write that card into the export.

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
        results: ``validate.py --results-file`` JSON files of the export's weights, added to a rewritten card.

    Returns:
        What ``HfApi.create_commit`` returns (the commit's info).

    Raises:
        HubAccessError: No token, a refused token or no connection (checked before anything else happens).
        FileNotFoundError: The export lacks a file the Hub needs.
    """
    export = find_export(target, which)
    files = export_files(export.path)
    new_card = not (keep_card and CARD_FILE in files)
    missing = [name for name in REQUIRED_FILES if name not in files and (name != CARD_FILE or not new_card)]
    if missing:
        raise FileNotFoundError(f'{export.path!r} lacks {", ".join(missing)}; nothing was uploaded')
    api = HfApi(token=token, library_name='timm', library_version=timm.__version__)
    check_access(api, token)
    card = build_card(export, repo_id, lipschitz, results) if new_card else None
    operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=os.path.join(export.path, name))
                  for name in files if card is None or (name != CARD_FILE and name not in card.plots)]
    if card is not None:
        operations.append(CommitOperationAdd(path_in_repo=CARD_FILE,
                                             path_or_fileobj=io.BytesIO(card.text.encode('utf-8'))))
        operations += [CommitOperationAdd(path_in_repo=name, path_or_fileobj=source)
                       for name, source in card.plots.items()]
    architecture = read_json(os.path.join(export.path, 'config.json'))['architecture']
    try:
        repo_url = api.create_repo(repo_id, private=private, exist_ok=True)
        commit = api.create_commit(repo_id=repo_url.repo_id, operations=operations, revision=revision,
                                   commit_message=commit_message or f'Add {architecture} weights')
    except Exception as e:  # noqa: BLE001  requests / httpx / huggingface_hub errors, by library version
        what = 'lost the connection to' if unreachable(e) else 'was refused by'
        raise HubAccessError(f'the upload to {repo_id} {what} the Hugging Face Hub ({_first_line(e)}); the export is '
                             f'unchanged, push again') from e
    if card is not None:
        save_card(export, card)
    return commit
