"""``python -m lipsformer.benchmark``: the benchmark of :mod:`lipsformer.instruments.benchmark` (also the
``lipsformer-benchmark`` command), models interleaved in one process, as ratios to the first."""
from .instruments.benchmark import cli

if __name__ == '__main__':
    raise SystemExit(cli())
