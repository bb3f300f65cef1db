"""Training curves from metrics.jsonl as PNGs, one or several runs overlaid.

  python -m mlm_jax.plot --workdir=runs/a [--workdir=runs/b ...] [--out=DIR]

writes loss.png, mlm_accuracy.png (train solid, eval dashed), mask_accuracy.png
(accuracy at slots that showed [MASK], next to always answering the most
frequent token), learning_rate.png and tokens_per_sec.png into DIR (default: the first workdir's plots/). Runs
are labelled by their workdir's name.
"""

from __future__ import annotations

import os
from collections.abc import Sequence

from mlm_jax.training import metrics as metrics_lib

# File name -> (title, y label, [(metrics.jsonl key, curve name, line style)]).
FIGURES: dict[str, tuple[str, str, list[tuple[str, str, str]]]] = {
    'loss': ('MLM loss', 'cross-entropy (nats)',
             [('loss', 'train', '-'), ('eval_loss', 'eval', '--')]),
    'mlm_accuracy': ('MLM accuracy', 'accuracy on masked tokens',
                     [('mlm_accuracy', 'train', '-'), ('eval_mlm_accuracy', 'eval', '--')]),
    'mask_accuracy': ('Accuracy at [MASK] slots', 'accuracy where the input showed [MASK]',
                      [('mask_accuracy', 'train', '-'), ('eval_mask_accuracy', 'eval', '--'),
                       ('eval_mask_baseline_accuracy', 'most frequent token', ':')]),
    'learning_rate': ('Learning rate', 'learning rate', [('learning_rate', '', '-')]),
    'tokens_per_sec': ('Throughput', 'tokens / s', [('tokens_per_sec', '', '-')]),
}


def pyplot():
  """matplotlib.pyplot drawing into files (the Agg backend, no display), imported at the first
  figure: only a command that draws pays for matplotlib. Every figure writer takes it here."""
  import matplotlib  # pylint: disable=import-outside-toplevel
  matplotlib.use('Agg')
  import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel
  return plt


def run_labels(workdirs: Sequence[str]) -> list[str]:
  """Workdir names; parent directories are added while two names clash."""
  parts = [os.path.abspath(w).rstrip(os.sep).split(os.sep) for w in workdirs]
  depth = 1
  while True:
    labels = [os.sep.join(p[-depth:]) for p in parts]
    if len(set(labels)) == len(labels) or depth >= max(len(p) for p in parts):
      return labels
    depth += 1


def plot_runs(workdirs: Sequence[str], out_dir: str | None = None) -> list[str]:
  """Writes the figures for `workdirs`; returns the paths written."""
  if not workdirs:
    raise ValueError('no workdir given')
  plt = pyplot()
  out_dir = out_dir or os.path.join(workdirs[0], 'plots')
  os.makedirs(out_dir, exist_ok=True)
  runs = [(label, metrics_lib.read_metrics(w)) for label, w in zip(run_labels(workdirs), workdirs)]
  for (label, series), w in zip(runs, workdirs):
    if not series:
      raise FileNotFoundError(f'{w} has no metrics (no {os.path.join(w, "metrics.jsonl")}).')
  colors = plt.rcParams['axes.prop_cycle'].by_key()['color']
  written = []
  for name, (title, ylabel, curves) in FIGURES.items():
    fig, ax = plt.subplots(figsize=(7, 4.5), dpi=100)
    drawn = 0
    for i, (label, series) in enumerate(runs):
      for key, curve, style in curves:
        points = sorted(series.get(key, {}).items())
        if not points:
          continue
        steps, values = zip(*points)
        ax.plot(steps, values, style, color=colors[i % len(colors)],
                marker='o' if len(points) == 1 else None,
                label=f'{label} {curve}'.strip())
        drawn += 1
    if not drawn:
      plt.close(fig)
      continue
    ax.set(title=title, xlabel='step', ylabel=ylabel)
    ax.ticklabel_format(axis='y', useOffset=False)  # Absolute values on the axis.
    ax.grid(alpha=0.3)
    ax.legend(fontsize='small')
    fig.tight_layout()
    path = os.path.join(out_dir, f'{name}.png')
    fig.savefig(path)
    plt.close(fig)
    written.append(path)
  return written
