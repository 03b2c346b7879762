"""Experiments that reproduce the paper's claims in miniature (``python -m lipsformer.experiments.<name>``)."""
