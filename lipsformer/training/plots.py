"""PNG curves of a run's metrics (loss, accuracy, alpha per stage); matplotlib is an optional dependency."""
import logging
import os
from typing import Any

_logger = logging.getLogger(__name__)

PLOTS_DIR = 'plots'


def write_plots(history: list[dict[str, Any]], run_dir: str) -> list[str]:
    """Draw ``loss.png``, ``accuracy.png`` and ``alpha.png`` into ``<run>/plots``; returns the files written.

    Without matplotlib nothing is drawn and a hint to install it is logged.
    """
    if not history:
        return []
    try:
        import matplotlib
        matplotlib.use('Agg')
        import matplotlib.pyplot as plt
    except ImportError:
        _logger.info('plots skipped: matplotlib is not installed (pip install "lipsformer[plots]")')
        return []
    folder = os.path.join(run_dir, PLOTS_DIR)
    os.makedirs(folder, exist_ok=True)
    written = []
    panels = [
        ('loss.png', 'loss', [('train_loss', 'train'), ('val_loss', 'val'), ('ema_val_loss', 'val (EMA)')]),
        ('accuracy.png', 'accuracy (%)', [('val_top1', 'top-1'), ('val_top5', 'top-5'),
                                          ('ema_val_top1', 'top-1 (EMA)'), ('ema_val_top5', 'top-5 (EMA)')]),
    ]
    for filename, ylabel, series in panels:
        curves = [(label, _series(history, key)) for key, label in series]
        curves = [(label, points) for label, points in curves if points]
        if curves:
            written.append(_draw(plt, os.path.join(folder, filename), ylabel, curves))
    alpha_means = sorted({k[:-len('/mean')] for line in history for k in line if k.startswith('alpha/')
                          and k.endswith('/mean')})
    if alpha_means:
        written.append(_draw_alpha(plt, os.path.join(folder, 'alpha.png'), history, alpha_means))
    return written


def _series(history: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    return [(line['epoch'], line[key]) for line in history if key in line]


def _draw(plt, path: str, ylabel: str, curves: list[tuple[str, list[tuple[int, float]]]]) -> str:
    figure, axis = plt.subplots(figsize=(6, 4))
    for label, points in curves:
        epochs, values = zip(*points, strict=True)
        axis.plot(epochs, values, marker='o', markersize=3, label=label)
    axis.set_xlabel('epoch')
    axis.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axis.set_ylabel(ylabel)
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def _draw_alpha(plt, path: str, history: list[dict[str, Any]], prefixes: list[str]) -> str:
    """Mean +- std of alpha per stage over epochs (the paper's Figure 5)."""
    figure, axis = plt.subplots(figsize=(6, 4))
    for prefix in prefixes:
        means = _series(history, f'{prefix}/mean')
        stds = dict(_series(history, f'{prefix}/std'))
        epochs, values = zip(*means, strict=True)
        spread = [stds.get(epoch, 0.0) for epoch in epochs]
        axis.plot(epochs, values, marker='o', markersize=3, label=prefix.split('/', 1)[1])
        low = [v - s for v, s in zip(values, spread, strict=True)]
        high = [v + s for v, s in zip(values, spread, strict=True)]
        axis.fill_between(epochs, low, high, alpha=0.2)
    axis.set_xlabel('epoch')
    axis.xaxis.set_major_locator(plt.MaxNLocator(integer=True))
    axis.set_ylabel('alpha (mean ± std)')
    axis.grid(alpha=0.3)
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path
