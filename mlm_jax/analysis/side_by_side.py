"""Ours next to Hugging Face's model of the same architecture, on the same rows and masks.

For each seed, our trainer (training/loop.py, as `train` runs it) trains the
config in WORKDIR/seed<S>; then Hugging Face's model of the variant
(`BertForMaskedLM` or `ModernBertForMaskedLM`, interop/torch_mlm.py, its own
initialisation) trains in PyTorch on the same global batches: the same
pipeline with the same seed yields the same rows and the same masks, step by
step. It gets our schedule's learning rate at every step and our AdamW
settings, clipping and weight-decay mask. Both are then evaluated as `train`
evaluates: the validation split with the same fixed masks, accuracy over all
masked slots and per kind of slot, next to the most frequent token's hit rate
there (step.slot_metrics).

Each finished half is kept (our run's summary.json, HF's hf.json in the seed's
directory), so a stopped comparison continues where it stopped.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable, Sequence
from typing import Any

import jax
import ml_collections
import numpy as np

from mlm_jax.config import checks
from mlm_jax.config import fields
from mlm_jax.config import run_plan
from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.data import prepared
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.errors import ConfigError
from mlm_jax.errors import require
from mlm_jax.interop import torch_mlm
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
from mlm_jax.training import loop
from mlm_jax.training import objective
from mlm_jax.training import optimizer

SYSTEMS = ('ours', 'hf')
# Figures each system reports per seed (the eval figures of summary.json, without 'eval_').
FIGURES = ('loss', 'mlm_accuracy', 'baseline_accuracy', 'mask_accuracy',
           'mask_baseline_accuracy', 'context_ratio')


def check(config: ml_collections.ConfigDict, seeds: Sequence[int]) -> None:
  """ConfigError for what the comparison cannot run, before anything trains."""
  checks.validate(config, num_devices=jax.device_count())
  require(len(seeds) > 0, '--seeds must name at least one seed, e.g. --seeds=0,1,2.')
  require(len(set(seeds)) == len(seeds), f'--seeds={",".join(map(str, seeds))} repeats a seed.')
  require(config.sentence_pair.task == 'none',
          "the side-by-side compares the MLM objective only: set "
          "--config.sentence_pair.task=none.")
  for field in ('document_mask', 'restart_positions'):
    require(not config.model[field],
            f"Hugging Face's model attends across a packed row's documents and counts positions "
            f'from its start: set --config.model.{field}=False for the comparison.')
  require(config.train.grad_accum_steps == 1,
          'the Hugging Face side steps once per batch: set --config.train.grad_accum_steps=1.')
  require(jax.process_count() == 1, 'the side-by-side runs in one process.')
  require(not config.init.hf_dir, 'both sides start from their own initialisation: leave '
          'config.init.hf_dir empty.')


def run(config: ml_collections.ConfigDict, workdir: str, seeds: Sequence[int],
        log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
  """Trains and evaluates both systems for every seed; returns every figure (see `table`)."""
  check(config, seeds)
  workdir = os.path.abspath(workdir)
  rows = []
  for seed in seeds:
    cfg = config.copy_and_resolve_references()
    cfg.seed = seed
    seed_dir = os.path.join(workdir, f'seed{seed}')
    log(f'seed {seed}: ours ({cfg.model.variant}) in {seed_dir}')
    ours = _ours(cfg, seed_dir)
    log(f'seed {seed}: Hugging Face {torch_mlm.hf_model_name(cfg.model.variant)}')
    hf = _cached(os.path.join(seed_dir, 'hf.json'), cfg, lambda c=cfg: train_hf(c, log))
    rows.append({'seed': seed, 'ours': ours, 'hf': hf})
  return {'variant': config.model.variant, 'hf_model': torch_mlm.hf_model_name(
      config.model.variant), 'num_steps': config.train.num_steps, 'workdir': workdir,
          'seeds': rows, 'mean': _means(rows)}


def _ours(config: ml_collections.ConfigDict, seed_dir: str) -> dict[str, Any]:
  """Our run's final evaluation: from its summary.json if it finished, else trained now."""
  saved = os.path.join(seed_dir, 'config.json')
  if os.path.exists(saved):
    with open(saved) as f:
      _check_same_config(json.load(f), config, saved)
  path = os.path.join(seed_dir, 'summary.json')
  if os.path.exists(path):
    with open(path) as f:
      done = json.load(f)
    if done.get('final_eval_step') == config.train.num_steps and 'eval_mask_accuracy' in done:
      return _ours_figures(done)
  run = run_plan.resolve(config, num_devices=jax.device_count(), workdir=seed_dir)
  return _ours_figures(loop.train_and_evaluate(run, seed_dir))


def _as_json(config: ml_collections.ConfigDict) -> dict[str, Any]:
  return json.loads(json.dumps(config.to_dict()))


def _check_same_config(saved: dict[str, Any], config: ml_collections.ConfigDict,
                       path: str) -> None:
  """ConfigError if a kept result was made with another config: it is kept, not reused."""
  saved = {k: v for k, v in saved.items() if k != 'resolved'}
  if saved != _as_json(config):
    raise ConfigError(
        f'{path} holds a run of another config; give side_by_side a new --workdir (the '
        'results there are left as they are).')


def _ours_figures(summary: dict[str, Any]) -> dict[str, Any]:
  """FIGURES of summary.json's last evaluation (loss and accuracy are its final_eval_ ones)."""
  key = lambda k: f'final_eval_{k}' if k in ('loss', 'mlm_accuracy') else f'eval_{k}'
  return {**{k: summary[key(k)] for k in FIGURES}, 'wall_time_s': summary['wall_time_s']}


def _cached(path: str, config: ml_collections.ConfigDict,
            compute: Callable[[], dict[str, Any]]) -> dict[str, Any]:
  """compute(), kept in `path` with the config; a kept result of the same config is read back."""
  if os.path.exists(path):
    with open(path) as f:
      done = json.load(f)
    _check_same_config(done['config'], config, path)
    return done['figures']
  figures = compute()
  os.makedirs(os.path.dirname(path), exist_ok=True)
  with open(path, 'w') as f:
    json.dump({'config': _as_json(config), 'figures': figures}, f, indent=2)
  return figures


def train_hf(config: ml_collections.ConfigDict,
             log: Callable[[str], None] = lambda s: None) -> dict[str, Any]:
  """Hugging Face's model of config.model.variant, trained and evaluated as ours is."""
  return train_hf_model(config, log)[1]


def train_hf_model(config: ml_collections.ConfigDict, log: Callable[[str], None] = lambda s: None
                   ) -> tuple[torch_mlm.TorchMLM, dict[str, Any]]:
  """(the trained model, train_hf's figures): the model also saves itself in the hub's layout."""
  start = time.perf_counter()
  config = run_plan.resolve(config, num_devices=jax.device_count()).config
  data = prepare.prepare(*fields.data_request(config))
  masker = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts)
  mesh = sharding.make_mesh(config.mesh.fsdp)
  # Our model's shape and compute dtype, as the trainer resolves them; nothing is allocated.
  vocab_size = tok_lib.model_vocab_size(config.model.vocab_size, data.tokenizer.vocab_size)
  model_cfg = build_lib.build(config, vocab_size, mesh).model_cfg
  model = torch_mlm.TorchMLM(config, model_cfg, specials=data.tokenizer.specials,
                             use_gpu=jax.default_backend() == 'gpu')
  train = config.train
  # Step s (from 1) trains with schedule(s - 1), as optax counts.
  lrs = np.asarray(optimizer.learning_rate_schedule(train)(np.arange(train.num_steps)))
  batches = pipeline.train_batches(
      data.source('train'), masker, global_batch=train.batch_size, seed=config.seed,
      prefetch=config.input.prefetch, worker_count=config.input.worker_count)
  try:
    for s in range(train.num_steps):
      loss = model.train_step(model.inputs(next(batches)), float(lrs[s]))
      if (s + 1) % train.log_every == 0 or s + 1 == train.num_steps:
        log(f'  HF step {s + 1}: loss {float(loss):.4f}, learning rate {lrs[s]:.3g}')
  finally:
    batches.close()
  figures = evaluate_hf(model, data, masker, config.eval, mesh.size)
  figures['wall_time_s'] = time.perf_counter() - start
  return model, figures


def evaluate_hf(model: torch_mlm.TorchMLM, data: prepared.PreparedData, masker: masking.Masker,
                eval_config: ml_collections.ConfigDict, num_devices: int) -> dict[str, Any]:
  """evaluate.evaluate's figures for the torch model: the same batches, masks and sums."""
  source = data.source('validation')
  baseline = data.most_frequent_token()
  sums: dict[str, float] = {}
  for batch in pipeline.eval_batches(
      source, masker, global_batch=pipeline.eval_batch_size(len(source), eval_config.batch_size,
                                                             num_devices),
      mask_seed=eval_config.mask_seed, max_batches=eval_config.max_batches):
    (rows, positions), predicted, loss = model.predict(batch)
    # Each masked token's target and kind, read off our slots at its (row, position).
    r, p = np.nonzero(batch['masked_weights'] > 0)
    at = np.zeros(batch['input_ids'].shape, np.int64)
    kind = np.zeros_like(at)
    at[r, batch['masked_positions'][r, p]] = batch['masked_ids'][r, p]
    kind[r, batch['masked_positions'][r, p]] = batch['masked_kinds'][r, p]
    target, kind = at[rows, positions], kind[rows, positions]
    correct, hit = predicted == target, target == baseline
    _add_sums(sums, '', correct, loss, hit)
    for i, name in enumerate(masking.SLOT_KINDS, start=1):
      sel = kind == i
      _add_sums(sums, f'{name}_', correct[sel], loss[sel], hit[sel])
  denom = max(sums['weight_sum'], 1.0)
  return {'loss': sums['loss_sum'] / denom, 'mlm_accuracy': sums['correct_sum'] / denom,
          **objective.slot_metrics(sums)}


def _add_sums(sums: dict[str, float], prefix: str, correct: np.ndarray, loss: np.ndarray,
              baseline_hit: np.ndarray) -> None:
  """Adds objective.mlm_loss_terms' sums (names and meaning) for one batch's tokens."""
  for name, value in (('loss_sum', loss.sum()), ('correct_sum', correct.sum()),
                      ('weight_sum', correct.size), ('baseline_sum', baseline_hit.sum())):
    sums[prefix + name] = sums.get(prefix + name, 0.0) + float(value)


def _means(rows: list[dict[str, Any]]) -> dict[str, Any]:
  """Per system and figure: mean and sample standard deviation over the seeds."""
  out = {}
  for system in SYSTEMS:
    out[system] = {}
    for k in (*FIGURES, 'wall_time_s'):
      values = np.array([r[system][k] for r in rows], np.float64)
      out[system][k] = {'mean': float(values.mean()),
                        'std': float(values.std(ddof=1)) if len(values) > 1 else 0.0}
  return out


def table(result: dict[str, Any]) -> str:
  """The comparison as a Markdown table, one line per seed and system, then the means."""
  names = {'ours': f'mlm_jax ({result["variant"]})', 'hf': f'HF {result["hf_model"]}'}
  lines = [f'{result["num_steps"]} steps per run; held-out accuracy, the most frequent token\'s '
           'rate in brackets.', '',
           '| seed | system | eval loss | all slots | [MASK] slots | context ratio | wall time |',
           '| --- | --- | --- | --- | --- | --- | --- |']
  for row in result['seeds']:
    for system in SYSTEMS:
      f = row[system]
      lines.append(
          f'| {row["seed"]} | {names[system]} | {f["loss"]:.4f} | {f["mlm_accuracy"]:.4f} '
          f'({f["baseline_accuracy"]:.4f}) | {f["mask_accuracy"]:.4f} '
          f'({f["mask_baseline_accuracy"]:.4f}) | {f["context_ratio"]:.2f}x | '
          f'{f["wall_time_s"]:.0f} s |')
  m = result['mean']
  for system in SYSTEMS:
    f = m[system]
    lines.append(
        f'| mean ± sd | {names[system]} | {_pm(f["loss"], 4)} | {_pm(f["mlm_accuracy"], 4)} | '
        f'{_pm(f["mask_accuracy"], 4)} | {_pm(f["context_ratio"], 2)}x | '
        f'{f["wall_time_s"]["mean"]:.0f} s |')
  n = len(result['seeds'])
  diff = m['ours']['mask_accuracy']['mean'] - m['hf']['mask_accuracy']['mean']
  noise = math.sqrt((m['ours']['mask_accuracy']['std']**2 + m['hf']['mask_accuracy']['std']**2)
                    / n)
  lines += ['', f'[MASK]-slot accuracy, ours minus HF: {diff:+.4f} (standard error of the '
            f'difference over {n} seed(s): {noise:.4f})']
  return '\n'.join(lines)


def _pm(stat: dict[str, float], digits: int) -> str:
  return f'{stat["mean"]:.{digits}f} ± {stat["std"]:.{digits}f}'
