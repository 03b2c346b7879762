#!/usr/bin/env python3
"""Train a LipsFormer (or any timm model) with the paper's no-warmup recipe; ``python train.py --help`` lists the
options, timm train.py's flags and the exit codes. The code lives in :mod:`lipsformer.training.train_command` (also the
``lipsformer-train`` command).

    python train.py --config configs/lipsformer_cswin_tiny.yaml --data-dir /data/imagenet --output runs/x
    python train.py --config configs/quickstart.yaml --output runs/q optimizer.lr=1e-3 train.epochs=2
"""
import sys

from lipsformer.training.train_command import main

if __name__ == '__main__':
    sys.exit(main())
