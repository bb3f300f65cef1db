"""Our run of one cell: the fine-tuning config a protocol's cell and seed make, finetune, scoring.

What must stay true: a cell is an ordinary fine-tuning (finetuning/loop.py),
resumable in its own directory, on the mesh of all devices; what the
protocol does not set is finetune's default. Its record carries the plan it
resolved to (row length, steps, warm-up, evaluation cadence), which
transformers' run of the same cell takes (hf_peer.py).
"""

from __future__ import annotations

import dataclasses
import json
import os
from typing import Any

import jax
import ml_collections

from mlm_jax.evaluation import protocols as protocols_lib
from mlm_jax.evaluation import scoring
from mlm_jax.evaluation import sweep as sweep_lib
from mlm_jax.finetuning import config as config_lib
from mlm_jax.finetuning import loop
from mlm_jax.finetuning import model_dir as model_dir_lib
from mlm_jax.finetuning import pretrained as pretrained_lib

# A cell saves a checkpoint for resuming this often (and at its end), not at every
# evaluation as finetune does by default: a sweep runs hundreds of cells, most of them short,
# and a stopped cell loses at most this many steps.
CHECKPOINT_EVERY = 1000
EVAL_BATCH = 64


def config_for(protocol: protocols_lib.Protocol, job: sweep_lib.Job) -> ml_collections.ConfigDict:
  """The fine-tuning config of a job: the cell's grid values, the seed, the protocol's optimizer
  and rows; finetune's defaults otherwise."""
  config = config_lib.get_config()
  cell, task = job.cell, job.suite_task.task
  config.seed = job.seed
  config.data.max_seq_len = protocol.max_seq_len
  for name, value in job.suite_task.fields.items():
    config.data[name] = value
  t = config.train
  t.batch_size, t.num_epochs, t.min_steps = cell.batch_size, cell.epochs, 0
  t.learning_rate, t.warmup_fraction = cell.learning_rate, cell.warmup
  t.weight_decay, t.grad_clip_norm = cell.weight_decay, protocol.grad_clip_norm
  t.adam_b1, t.adam_b2, t.adam_eps = protocol.adam_b1, protocol.adam_b2, protocol.adam_eps
  t.best_metric = task.run_score
  t.tensorboard = False   # Hundreds of cells: metrics.jsonl is enough.
  t.checkpoint_every = CHECKPOINT_EVERY
  if protocol.within_run == 'last':
    t.eval_every = 10**9   # Only the evaluation at the last step, which every run makes.
  devices = jax.device_count()
  config.eval.batch_size = -(-EVAL_BATCH // devices) * devices
  return config


def make_runner(protocol: protocols_lib.Protocol, pretrained: pretrained_lib.Pretrained,
                root: str) -> sweep_lib.Runner:
  """Our runner: each job fine-tuned from `pretrained` (or its MNLI start) and scored."""

  def run(job: sweep_lib.Job) -> dict[str, Any]:
    start = pretrained if job.start is None else pretrained_lib.from_finetuned(job.start)
    # The rows' length comes from the files (at most the protocol's), not the pretraining's.
    start = dataclasses.replace(start, seq_len=None)
    st = job.suite_task
    dev = st.task.dev_splits[0]
    result = loop.finetune(None, job.model_dir, st.task.kind, st.files['train'], st.files[dev],
                           config_for(protocol, job), pretrained=start)
    if result['stopped']:
      raise sweep_lib.Stopped(job.name)
    metrics = scoring.score_model(job.model_dir, st.task, st.files)
    return {'metrics': metrics, 'best_step': result.get('best_step'),
            'plan': resolved_plan(job.model_dir)}

  return sweep_lib.Runner('ours', root, run)


def resolved_plan(out_dir: str) -> dict[str, Any]:
  """What the fine-tuning resolved to (config.json's 'resolved'): rows, steps, cadence."""
  with open(os.path.join(out_dir, model_dir_lib.CONFIG_FILE)) as f:
    resolved = json.load(f)['resolved']
  keys = ('seq_len', 'num_steps', 'steps_per_epoch', 'warmup_steps', 'learning_rate',
          'eval_every', 'train_rows', 'eval_rows', 'train_truncated', 'eval_truncated')
  return {k: resolved[k] for k in keys if k in resolved}
