#!/usr/bin/env python3
"""Evaluate timm / LipsFormer models on ImageNet val, ImageNet-ReaL and ImageNet-V2 in one run.

``python validate.py --help`` lists the options; the code lives in :mod:`lipsformer.evaluation`.
"""
import sys

import lipsformer  # noqa: F401  registers the LipsFormer models with timm's factory
from lipsformer.evaluation.validate_command import main

if __name__ == '__main__':
    sys.exit(main())
