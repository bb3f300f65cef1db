"""Probing a training run's encoder: one task (probe) or all built-in tasks vs random init (evaluate).

`probe_run` reads a workdir's tokenizer and checkpoint, makes a built-in
task (tasks.py), computes the frozen features of every layer (features.py)
and trains the single-layer and scalar-mix probes (scalar_mix.py).
`evaluate_run` does that for every built-in task and `seeds` seeds, for the
run and for a randomly initialised encoder of the same shape (the baseline
that says what pretraining added), and tabulates mean ± std of the mix
probe's test accuracy.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any

import numpy as np

from mlm_jax.analysis import plot
from mlm_jax.probing import features
from mlm_jax.probing import scalar_mix
from mlm_jax.probing import tasks as tasks_lib
from mlm_jax.training import workdir as workdir_lib


def _task_features(run: workdir_lib.TrainedRun, name: str, seed: int,
                   params_by_name: dict[str, Any]) -> tuple[tasks_lib.Task, dict, int]:
  """(task, {name: features [L + 1, N, d]}, texts cut to fit T)."""
  seq_len = run.config.data.seq_len
  task = tasks_lib.make(name, seed, lambda texts: features.pieces(run.tokenizer, texts),
                        max_pieces=seq_len - 2)
  inputs, cut = features.encode(run.tokenizer, task.texts, seq_len)
  return task, {k: features.mean_pooled_layers(run.model_cfg, p, inputs)
                for k, p in params_by_name.items()}, cut


def probe_run(workdir: str, task_name: str, seed: int = 0, step: int | None = None,
              cfg: scalar_mix.ProbeConfig = scalar_mix.ProbeConfig()) -> dict[str, Any]:
  """Probes checkpoint `step` (default: the latest) of a run on one built-in task."""
  run = workdir_lib.load(workdir, step)
  start = time.perf_counter()
  task, feats, cut = _task_features(run, task_name, seed, {'run': run.params})
  result = scalar_mix.probe(feats['run'], task.labels, task.num_classes, seed, cfg)
  return {'workdir': run.workdir, 'checkpoint_step': run.step, 'task': task.name,
          'seed': seed, 'num_classes': task.num_classes, 'label_names': task.label_names,
          'texts_cut_to_fit': cut, 'seconds': round(time.perf_counter() - start, 1),
          'probe': vars(cfg), **result}


def format_probe(report: dict[str, Any]) -> str:
  lines = [f'Probe of {report["workdir"]} (step {report["checkpoint_step"]}) on '
           f'{report["task"]}: {report["num_classes"]} classes, chance '
           f'{report["chance"]:.3f}, {report["examples"]["test"]} test examples',
           f'{"layer":>6} {"accuracy":>9} {"mix weight":>11}']
  for i, (acc, w) in enumerate(zip(report['layer_accuracy'], report['mix_weights'])):
    lines.append(f'{i:>6} {acc:>9.3f} {w:>11.3f}')
  lines.append(f'{"mix":>6} {report["mix_accuracy"]:>9.3f}   (gamma {report["gamma"]:.2f}, '
               f'expected layer {report["expected_layer"]:.2f})')
  if report['texts_cut_to_fit']:
    lines.append(f'{report["texts_cut_to_fit"]} texts were longer than T and cut to fit.')
  return '\n'.join(lines)


def write_probe(report: dict[str, Any], out_dir: str) -> str:
  """out_dir/TASK.json and TASK.png (accuracy per layer and the mix weights); returns the stem."""
  os.makedirs(out_dir, exist_ok=True)
  stem = os.path.join(out_dir, report['task'])
  with open(stem + '.json', 'w') as f:
    json.dump(report, f, indent=2)
  plt = plot.pyplot()
  layers = np.arange(len(report['mix_weights']))
  fig, (w_ax, acc_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
  w_ax.bar(layers, report['mix_weights'], color='C0')
  w_ax.axhline(1 / len(layers), color='gray', linestyle='--', label='uniform')
  w_ax.axvline(report['expected_layer'], color='C3', label='expected layer')
  w_ax.set(xlabel='layer (0: embeddings)', ylabel='scalar mix weight', xticks=layers,
           title=f'{report["task"]}: learned mix')
  w_ax.legend()
  acc_ax.plot(layers, report['layer_accuracy'], 'o-', label='one layer')
  acc_ax.axhline(report['mix_accuracy'], color='C1', label='scalar mix')
  acc_ax.axhline(report['chance'], color='gray', linestyle='--', label='chance')
  acc_ax.set(xlabel='layer (0: embeddings)', ylabel='test accuracy', xticks=layers,
             title='probe accuracy')
  acc_ax.legend()
  fig.tight_layout()
  fig.savefig(stem + '.png')
  plt.close(fig)
  return stem


def evaluate_run(workdir: str, seeds: int = 3, task_names: tuple[str, ...] = tasks_lib.TASKS,
                 step: int | None = None, cfg: scalar_mix.ProbeConfig = scalar_mix.ProbeConfig(),
                 log=print) -> dict[str, Any]:
  """Every task x seed: the mix probe's test accuracy on the run and on a random init."""
  run = workdir_lib.load(workdir, step)
  rows = []
  for name in task_names:
    scores: dict[str, list[float]] = {'run': [], 'random': []}
    best_layers = []
    for seed in range(seeds):
      params = {'run': run.params, 'random': features.random_params(run.model_cfg, seed)}
      task, feats, _ = _task_features(run, name, seed, params)
      for kind, f in feats.items():
        result = scalar_mix.probe(f, task.labels, task.num_classes, seed, cfg)
        scores[kind].append(result['mix_accuracy'])
        if kind == 'run':
          best_layers.append(int(np.argmax(result['layer_accuracy'])))
      log(f'{name} seed {seed}: run {scores["run"][-1]:.3f}, random {scores["random"][-1]:.3f}')
    rows.append({'task': name, 'num_classes': task.num_classes, 'chance': 1 / task.num_classes,
                 'examples': len(task.texts),
                 **{k: {'mean': float(np.mean(v)), 'std': float(np.std(v)), 'seeds': v}
                    for k, v in scores.items()},
                 'best_single_layer': best_layers})
  return {'workdir': run.workdir, 'checkpoint_step': run.step, 'seeds': seeds,
          'probe': vars(cfg), 'tasks': rows}


def format_evaluation(report: dict[str, Any]) -> str:
  """A markdown table: mix-probe test accuracy, this run vs random init, mean ± std."""
  lines = [f'| task | classes | chance | this run (step {report["checkpoint_step"]}) '
           '| random init | difference |', '| --- | --- | --- | --- | --- | --- |']
  for r in report['tasks']:
    diff = r['run']['mean'] - r['random']['mean']
    lines.append(f'| {r["task"]} | {r["num_classes"]} | {r["chance"]:.3f} '
                 f'| {r["run"]["mean"]:.3f} ± {r["run"]["std"]:.3f} '
                 f'| {r["random"]["mean"]:.3f} ± {r["random"]["std"]:.3f} | {diff:+.3f} |')
  return '\n'.join(lines)
