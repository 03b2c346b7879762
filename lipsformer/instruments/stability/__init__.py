"""Stable training without warmup, the central claim of LipsFormer (Qi et al., ICLR 2023), reproduced in miniature.

A small but deep LipsFormer-CSwin trained on real Fashion-MNIST (or any image folder) with AdamW and cosine decay, no
warmup and no gradient clipping, swept over seven learning rates 1e-3 ... 6.4e-2 spaced 2x, in eleven arms
(:mod:`.arms`): the full model, each Lipschitz component swapped alone for its standard counterpart, all swapped at
once (a post-norm and a pre-norm Transformer of the same shape), and the full model and both Transformers with 5
epochs of warmup; three seeds each, 231 runs, fewer where a seed that has failed at two consecutive rates is left out
of its arm's higher ones (:mod:`.pruning`).

- :mod:`.arms`: the arms and the model shape they share; :mod:`.subsets`: the data as in-memory tensors, and batches;
- :mod:`.training_run`: one run, resumable; :mod:`.grid`: the queue of runs, shared by several processes with locks;
  :mod:`.pruning`: which runs the queue leaves out after a seed's consecutive failures;
- :mod:`.sweep_results`: the committed results file (one line per run), collected from the run folders;
- :mod:`.report`: failures classified, the doc's tables and its figure, from the results file alone.

Sized so that the whole grid runs on a small CPU, one thread per run (docs/stability.md gives the measured cost):

- Model: LipsFormer-CSwin, embed_dim 16 (stage widths 16, 32, 64, 128), depths (1, 2, 21, 1) = 25 blocks (the
  paper's CSwin-T depths), heads (2, 2, 4, 8), stripes (1, 2, 2, 1), patch 4 on 32x32 inputs (maps 8, 4, 2, 1),
  drop path 0; about 1.6M parameters with conv shortcuts D.
- Data: Fashion-MNIST padded from 28x28 to 32x32, a fixed class-balanced train subset of 1280 images (128 per class;
  one epoch = 20 steps) with random horizontal flips, and a fixed class-balanced test subset of 2000 images.
- Training: 500 steps of batch 64 (25 epochs), AdamW (weight decay 0.05, none on 1-D parameters), cosine decay to
  lr / 100, cross-entropy without label smoothing. The warmup arms warm up linearly over 5 epochs = 100 steps,
  20% of the run (the paper: 5 of 100 epochs, 5%).

Records per run (``OUT/torch-<version>/<arm>/lr<lr>/seed<seed>/``, see :mod:`.training_run`): per step the loss,
gradient norm, largest per-token activation norm over block outputs and learning rate; every 50 steps the test
accuracy; at the first step the log10 of Theorem 2's product bound over the parts of the network that have a bound
(with the authors' SCSA, whose values are not normalised, and with LayerNorm or dot-product attention, the full
product is infinite); both at the end. A non-finite loss stops the run, recorded as diverged at that step.

    python -m lipsformer.instruments.stability --out runs/stability/fashion_mnist             # run or resume the sweep
    python -m lipsformer.instruments.stability --out runs/stability/fashion_mnist --collect   # -> results/stability/
    python -m lipsformer.instruments.stability --report docs     # docs/stability.md's tables and figure
"""
