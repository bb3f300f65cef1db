"""A worked domain adaptation, measured: a general model continued on a domain corpus.

No hub is reachable here, so the "published" general model is made the way
one is published, then adapted as a user adapts one:

  1. corpora (OUT/corpora): general = the default corpus (docstrings of the
     Python standard library); domain = the docstrings of the scientific
     Python packages installed (numpy and scipy: arrays, linear algebra,
     statistics, signal processing, optimisation); a domain task = which
     scipy subpackage a docstring's first 400 characters come from.
  2. published (OUT/published): a byte-level BPE tokenizer trained on the
     general corpus (Hugging Face tokenizers), and Hugging Face's
     ModernBertForMaskedLM trained by transformers in PyTorch on the general
     corpus's rows, saved with save_pretrained next to the tokenizer files
     (the hub's file layout).
  3. before: the published model on held-out domain text (`train --eval_only`).
  4. continued: `train --config.init.hf_dir=OUT/published` on the domain
     corpus, once per learning rate; the best one is also evaluated on
     held-out general text (what it kept).
  5. from scratch: the same tokenizer, shape and steps from a random init
     (the recipe that trains this shape from scratch: configs/tiny.py's).
  6. fine-tuning on the domain task from the published model (before), the
     best continued run (after) and the from-scratch run.

Every held-out figure is the [MASK]-slot accuracy next to always answering
the most frequent token there (and their ratio), on the same rows and masks.
"""

from __future__ import annotations

import glob
import json
import os
import random
import shutil
import time
from collections.abc import Callable, Sequence
from typing import Any

import ml_collections

from mlm_jax.config import fields
from mlm_jax.data import corpus as corpus_lib

# The domain: packages whose docstrings make the domain corpus.
DOMAIN_PACKAGES = ('numpy', 'scipy')
# The domain task's labels: scipy subpackages with enough docstrings.
TASK_LABELS = ('stats', 'optimize', 'signal', 'sparse', 'interpolate', 'special', 'linalg',
               'spatial', 'integrate')
TASK_TEXT_CHARS = 400


# ------------------------------------------------------------------ corpora


def write_corpora(out: str, task_train: int = 1000, task_eval: int = 500,
                  seed: int = 0) -> dict[str, str]:
  """general.jsonl, domain.jsonl and the task's train/eval .jsonl under OUT/corpora; their paths."""
  directory = os.path.join(out, 'corpora')
  paths = {name: os.path.join(directory, f'{name}.jsonl')
           for name in ('general', 'domain', 'task_train', 'task_eval')}
  if all(os.path.exists(p) for p in paths.values()):
    return paths
  os.makedirs(directory, exist_ok=True)
  _write_jsonl(paths['general'], ({'text': d} for d in corpus_lib.stdlib_docstrings()))
  domain, labelled = [], []
  for package in DOMAIN_PACKAGES:
    try:
      module = __import__(package)
    except ImportError as e:
      raise ImportError(f'the domain corpus is the docstrings of {", ".join(DOMAIN_PACKAGES)}: '
                        f'pip install {package}') from e
    root = os.path.dirname(module.__file__)
    for path in sorted(glob.glob(os.path.join(root, '**', '*.py'), recursive=True)):
      if f'{os.sep}tests{os.sep}' in path:
        continue
      parts = os.path.relpath(path, root).split(os.sep)
      for doc in corpus_lib.docstrings_of(path):
        domain.append({'text': doc})
        if package == 'scipy' and len(parts) > 1 and parts[0] in TASK_LABELS:
          labelled.append({'text': doc[:TASK_TEXT_CHARS], 'label': parts[0]})
  _write_jsonl(paths['domain'], domain)
  random.Random(seed).shuffle(labelled)
  _write_jsonl(paths['task_train'], labelled[:task_train])
  _write_jsonl(paths['task_eval'], labelled[task_train:task_train + task_eval])
  return paths


def _write_jsonl(path: str, records) -> None:
  tmp = path + '.tmp'
  with open(tmp, 'w', encoding='utf-8') as f:
    for r in records:
      f.write(json.dumps(r, ensure_ascii=False) + '\n')
  os.replace(tmp, path)


# --------------------------------------------------------- the "published" model


def make_published(out: str, config: ml_collections.ConfigDict, general: str,
                   log: Callable[[str], None]) -> str:
  """OUT/published: the general tokenizer and Hugging Face's model trained on the general corpus."""
  from mlm_jax.analysis import side_by_side  # pylint: disable=import-outside-toplevel
  from mlm_jax.data import prepare  # pylint: disable=import-outside-toplevel
  published = os.path.join(out, 'published')
  if os.path.exists(os.path.join(published, 'model.safetensors')):
    return published
  config = _with(config, {'data.corpus': general,
                          'data.data_dir': os.path.join(out, 'data', 'general')})
  data = prepare.prepare(*fields.data_request(config))
  start = time.perf_counter()
  model, figures = side_by_side.train_hf_model(config, log)
  tmp = published + '.tmp'
  shutil.rmtree(tmp, ignore_errors=True)
  model.save_pretrained(tmp, data.tokenizer, model_max_length=config.model.max_position_embeddings)
  os.replace(tmp, published)
  log(f'published model: {model.name} trained {config.train.num_steps} steps on the general '
      f'corpus in {time.perf_counter() - start:.0f} s; general held-out [MASK] slots '
      f'{figures["mask_accuracy"]:.4f} vs {figures["mask_baseline_accuracy"]:.4f}')
  return published


# ------------------------------------------------------------------ the runs


def _with(config: ml_collections.ConfigDict, fields: dict[str, Any]) -> ml_collections.ConfigDict:
  config = config.copy_and_resolve_references()
  for key, value in fields.items():
    section, name = key.split('.')
    with config[section].ignore_type():
      config[section][name] = value
  return config


_FIGURES = ('mask_accuracy', 'mask_baseline_accuracy', 'context_ratio', 'mlm_accuracy', 'loss')


def _figures(result: dict[str, Any]) -> dict[str, float]:
  """The held-out figures of an evaluation (evaluate_start's result)."""
  return {k: float(result[k]) for k in _FIGURES}


def _trained(config: ml_collections.ConfigDict, workdir: str) -> dict[str, float]:
  """Trains `config` in `workdir` (or finds it trained), then evaluates its last weights as
  every other model here is evaluated."""
  from mlm_jax.training import loop  # pylint: disable=import-outside-toplevel
  loop.train_and_evaluate(_resolved(config, workdir), workdir)
  return _figures(loop.evaluate_start(_resolved(_with(
      config, {'init.hf_dir': '', 'init.workdir': workdir, 'tokenizer.model_file': ''})).config))


def _resolved(config: ml_collections.ConfigDict, workdir: str | None = None) -> Any:
  """`config` as a run uses it (run_plan.resolve, a RunPlan): what each stage hands the loop."""
  import jax  # pylint: disable=import-outside-toplevel

  from mlm_jax.config import run_plan  # pylint: disable=import-outside-toplevel
  return run_plan.resolve(config, num_devices=jax.device_count(), workdir=workdir)


def run(out: str, *, general_steps: int = 2000, domain_steps: int = 1000,
        learning_rates: Sequence[float] = (1e-4, 3e-4, 1e-3), warmup_fraction: float = 0.1,
        config: ml_collections.ConfigDict, log: Callable[[str], None] = print) -> dict[str, Any]:
  """Every stage (each kept in OUT and reused when run again); returns the figures."""
  from mlm_jax.finetuning import config as ft_config  # pylint: disable=import-outside-toplevel
  from mlm_jax.finetuning import loop as ft_loop  # pylint: disable=import-outside-toplevel
  from mlm_jax.training import loop  # pylint: disable=import-outside-toplevel
  out = os.path.abspath(out)
  paths = write_corpora(out)
  published = make_published(out, _with(config, {'train.num_steps': general_steps}),
                             paths['general'], log)
  domain_data = os.path.join(out, 'data', 'domain')
  general_data = os.path.join(out, 'data', 'general_from_published')
  domain = _with(config, {'data.corpus': paths['domain'], 'data.data_dir': domain_data,
                          'train.num_steps': domain_steps})
  result: dict[str, Any] = {'general_steps': general_steps, 'domain_steps': domain_steps,
                            'published': published}
  done_path = os.path.join(out, 'result.json')
  if os.path.exists(done_path):
    with open(done_path) as f:
      result |= json.load(f)

  def stage(name: str, compute: Callable[[], Any]) -> Any:
    if name not in result:
      start = time.perf_counter()
      result[name] = compute()
      log(f'{name}: {result[name]} ({time.perf_counter() - start:.0f} s)')
      with open(done_path, 'w') as f:
        json.dump(result, f, indent=2)
    return result[name]

  before = _with(domain, {'init.hf_dir': published})
  stage('before', lambda: _figures(loop.evaluate_start(_resolved(before).config)))
  warmup = max(1, round(warmup_fraction * domain_steps))
  for lr in learning_rates:
    stage(f'continued_lr{lr:g}', lambda lr=lr: _trained(
        _with(before, {'train.learning_rate': lr, 'train.warmup_steps': warmup}),
        os.path.join(out, f'continued_lr{lr:g}')))
  best = max(learning_rates, key=lambda lr: result[f'continued_lr{lr:g}']['mask_accuracy'])
  result['best_learning_rate'] = best
  best_dir = os.path.join(out, f'continued_lr{best:g}')
  general_heldout = _with(config, {'data.corpus': paths['general'], 'data.data_dir': general_data})
  stage('general_before', lambda: _figures(loop.evaluate_start(
      _resolved(_with(general_heldout, {'init.hf_dir': published})).config)))
  stage('general_after', lambda: _figures(loop.evaluate_start(
      _resolved(_with(general_heldout, {'init.workdir': best_dir})).config)))
  scratch_dir = os.path.join(out, 'scratch')
  stage('scratch', lambda: _trained(_with(domain, {'tokenizer.model_file': published}),
                                    scratch_dir))

  def finetune(name: str, workdir: str | None = None,
               hf_dir: str | None = None) -> dict[str, float]:
    summary = ft_loop.finetune(workdir, os.path.join(out, f'finetune_{name}'), 'classify',
                               paths['task_train'], paths['task_eval'], ft_config.get_config(),
                               hf_dir=hf_dir)
    return {k: float(v) for k, v in summary.items()
            if (k.startswith('eval_') or k == 'best_step') and isinstance(v, (int, float))}

  stage('finetune_before', lambda: finetune('before', hf_dir=published))
  stage('finetune_after', lambda: finetune('after', workdir=best_dir))
  stage('finetune_scratch', lambda: finetune('scratch', workdir=scratch_dir))
  return result


def table(result: dict[str, Any]) -> str:
  """The measured figures as Markdown."""
  def row(name: str, f: dict[str, float]) -> str:
    return (f'| {name} | {f["mask_accuracy"]:.4f} | {f["mask_baseline_accuracy"]:.4f} | '
            f'{f["context_ratio"]:.2f}x | {f["mlm_accuracy"]:.4f} | {f["loss"]:.4f} |')
  n = result['domain_steps']
  lines = ['| model | [MASK] slots | most frequent token there | ratio | all slots | loss |',
           '| --- | --- | --- | --- | --- | --- |',
           row('published general model (before)', result['before'])]
  for key in sorted(k for k in result if k.startswith('continued_lr')):
    lr = key[len('continued_lr'):]
    mark = ' (best)' if float(lr) == result['best_learning_rate'] else ''
    lines.append(row(f'continued {n} steps, peak lr {lr}{mark}', result[key]))
  lines.append(row(f'from scratch {n} steps, same tokenizer', result['scratch']))
  lines += ['', 'Held-out general text (what continued pretraining kept):', '',
            lines[0], lines[1], row('published general model', result['general_before']),
            row(f'continued, lr {result["best_learning_rate"]:g}', result['general_after'])]
  metric = next((k for k in ('eval_accuracy', 'eval_best_accuracy') if k in result[
      'finetune_before']), None)
  if metric:
    lines += ['', f'Fine-tuning on the domain task ({metric}):', '',
              '| start | accuracy |', '| --- | --- |']
    for key, name in (('finetune_before', 'published general model'),
                      ('finetune_after', 'after continued pretraining'),
                      ('finetune_scratch', 'from scratch on the domain')):
      lines.append(f'| {name} | {result[key][metric]:.4f} |')
  return '\n'.join(lines)
