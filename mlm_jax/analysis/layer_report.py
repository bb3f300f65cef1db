"""What each layer has learned: the trained MLM head read out at every layer.

`python -m mlm_jax.layer_report --workdir=W [--max_batches=N] [--step=S]`
runs the head of checkpoint S (default: the latest) on the output of the
embeddings (layer 0) and of every block (layers 1..L) for the held-out masked
tokens that training evaluates on (the validation split with the fixed masks
of config.eval.mask_seed), and writes the MLM loss and accuracy per layer to
W/layer_report.{json,csv,png} and a table to stdout.

The head was trained on the last layer only, so this is a "logit lens": a low
accuracy at a lower layer says its representation is not yet in the form the
head reads, not that the information is absent (a probe trained per layer
would tell that). The last row equals the run's own eval metric (same masks,
same batches when --max_batches matches config.eval.max_batches).
"""

from __future__ import annotations

import csv
import json
import os
from typing import Any

import jax
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.analysis import plot
from mlm_jax.data import masking
from mlm_jax.data import pipeline as input_pipeline
from mlm_jax.data import prepared
from mlm_jax.training import objective
from mlm_jax.training import workdir as workdir_lib


def _layer_terms_fn(model: model_lib.BertForMLM, baseline_token: int):
  """jit(params, batch) -> the sums of objective.mlm_loss_terms, each [L + 1]."""

  def layer_terms(params, batch):
    layers = model.apply({'params': params}, batch, method=model_lib.BertForMLM.all_layers)

    def one_layer(sequence):  # [B, T, d] -> scalar sums
      logits = model.apply({'params': params}, sequence, batch['masked_positions'],
                           method=model_lib.BertForMLM.mlm_logits)
      return objective.mlm_loss_terms(logits, batch['masked_ids'], batch['masked_weights'],
                                      batch['masked_kinds'], baseline_token)

    # One layer's [B, P, V] logits at a time, not all L + 1 at once.
    return jax.lax.map(one_layer, layers)

  return jax.jit(layer_terms)


def layer_report(workdir: str, *, max_batches: int | None = None,
                 step: int | None = None) -> dict[str, Any]:
  """Computes the per-layer table and writes WORKDIR/layer_report.{json,csv,png}.

  max_batches: evaluation batches to use (None: config.eval.max_batches of
  the run; 0: the whole validation split).
  """
  run = workdir_lib.load(workdir, step)
  config = run.config
  data_dir = config['resolved']['data_dir']
  if not os.path.exists(os.path.join(data_dir, 'stats.json')):
    raise FileNotFoundError(
        f'the prepared data of this run ({data_dir}, from config.json) is missing; '
        'prepare it again with the run\'s config (python -m mlm_jax.train does).')
  data = prepared.load(data_dir)
  tokenizer = data.tokenizer
  masker = masking.make_masker(config.masking, tokenizer, data.unigram_counts)
  source = data.source('validation')
  # The batch size the run evaluated with: the masks depend on it.
  global_batch = input_pipeline.eval_batch_size(
      len(source), config['eval']['batch_size'], config['resolved']['num_devices'])
  if max_batches is None:
    max_batches = config['eval']['max_batches']

  model = model_lib.mlm_model(run.model_cfg)
  params = jax.device_put(run.params)
  top_token = data.most_frequent_token()
  layer_terms = _layer_terms_fn(model, top_token)
  num_layers = run.model_cfg.num_layers + 1
  totals: dict[str, np.ndarray] = {}
  num_batches = 0
  for batch in input_pipeline.eval_batches(source, masker, global_batch=global_batch,
                                           mask_seed=config['eval']['mask_seed'],
                                           max_batches=max_batches):
    for k, v in jax.device_get(layer_terms(params, batch)).items():
      totals[k] = totals.get(k, np.zeros(num_layers)) + np.asarray(v, np.float64)
    num_batches += 1

  denom = np.maximum(totals['weight_sum'], 1.0)
  by_layer = [objective.slot_metrics({k: v[i] for k, v in totals.items()})
              for i in range(num_layers)]
  layers = [{'layer': i,
             'module': 'encoder/embeddings' if i == 0 else f'encoder/layer_{i - 1}',
             'loss': float(totals['loss_sum'][i] / denom[i]),
             'mlm_accuracy': float(totals['correct_sum'][i] / denom[i]),
             'mask_accuracy': by_layer[i].get('mask_accuracy'),
             'num_masked': int(totals['weight_sum'][i])} for i in range(num_layers)]
  report = {'workdir': run.workdir, 'checkpoint_step': run.step, 'num_batches': num_batches,
            'batch_size': global_batch, 'mask_seed': config['eval']['mask_seed'],
            'baseline_token': data.tokenizer.id_to_piece(top_token),
            'baseline_accuracy': by_layer[0]['baseline_accuracy'],
            'mask_baseline_accuracy': by_layer[0].get('mask_baseline_accuracy'),
            'layers': layers}
  _write(run.workdir, report)
  return report


def format_table(report: dict[str, Any]) -> str:
  lines = [f'Checkpoint {report["checkpoint_step"]}: the MLM head on every layer\'s output, '
           f'{report["layers"][0]["num_masked"]} held-out masked tokens',
           f'{"layer":>5}  {"module":<20} {"loss":>8}  {"MLM accuracy":>12}  '
           f'{"at [MASK]":>9}']
  for row in report['layers']:
    mask = '' if row['mask_accuracy'] is None else f'{row["mask_accuracy"]:>9.4f}'
    lines.append(f'{row["layer"]:>5}  {row["module"]:<20} {row["loss"]:>8.4f}  '
                 f'{row["mlm_accuracy"]:>12.4f}  {mask}')
  lines.append(f'Always predicting {report["baseline_token"]!r}: accuracy '
               f'{report["baseline_accuracy"]:.4f}'
               + ('' if report['mask_baseline_accuracy'] is None else
                  f', at [MASK] slots {report["mask_baseline_accuracy"]:.4f}'))
  return '\n'.join(lines)


def _write(workdir: str, report: dict[str, Any]) -> None:
  with open(os.path.join(workdir, 'layer_report.json'), 'w') as f:
    json.dump(report, f, indent=2)
  with open(os.path.join(workdir, 'layer_report.csv'), 'w', newline='') as f:
    writer = csv.DictWriter(f, fieldnames=list(report['layers'][0]))
    writer.writeheader()
    writer.writerows(report['layers'])
  _plot(report, os.path.join(workdir, 'layer_report.png'))


def _plot(report: dict[str, Any], path: str) -> None:
  plt = plot.pyplot()
  rows = report['layers']
  x = [r['layer'] for r in rows]
  fig, (acc_ax, loss_ax) = plt.subplots(1, 2, figsize=(10, 4), dpi=100)
  acc_ax.plot(x, [r['mlm_accuracy'] for r in rows], 'o-', label='MLM head, all slots')
  acc_ax.axhline(report['baseline_accuracy'], color='gray', linestyle='--',
                 label=f'always {report["baseline_token"]!r}')
  if report['mask_baseline_accuracy'] is not None:
    acc_ax.plot(x, [r['mask_accuracy'] for r in rows], 's-', color='C2',
                label='MLM head, [MASK] slots')
    acc_ax.axhline(report['mask_baseline_accuracy'], color='C2', linestyle=':',
                   label=f'always {report["baseline_token"]!r}, [MASK] slots')
  acc_ax.set(title='Held-out MLM accuracy', xlabel='layer (0 = embeddings)', ylabel='accuracy')
  acc_ax.legend(fontsize='small')
  loss_ax.plot(x, [r['loss'] for r in rows], 'o-', color='C1')
  loss_ax.set(title='Held-out MLM loss', xlabel='layer (0 = embeddings)',
              ylabel='cross-entropy (nats)')
  for ax in (acc_ax, loss_ax):
    ax.set_xticks(x)
    ax.ticklabel_format(axis='y', useOffset=False)  # Absolute values on the axis.
    ax.grid(alpha=0.3)
  fig.suptitle(f'{os.path.basename(report["workdir"])}, step {report["checkpoint_step"]}')
  fig.tight_layout()
  fig.savefig(path)
  plt.close(fig)
