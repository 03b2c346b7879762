"""``python -m lipsformer.lipschitz --model NAME [--checkpoint PATH] [--img-size N] [--json OUT]``."""
import sys

from .report_command import main

if __name__ == '__main__':
    sys.exit(main())
