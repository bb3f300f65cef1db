"""Probing: the scalar-mix probe, the built-in tasks, and a pretrained encoder against random init."""

import copy
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlm_jax.probing import features
from mlm_jax.probing import runs
from mlm_jax.probing import scalar_mix
from mlm_jax.probing import tasks
from tests.conftest import REPO
from tests.conftest import run_training

_FAST = scalar_mix.ProbeConfig(hidden=32, steps=150)


@pytest.mark.slow
def test_probe_finds_a_planted_signal_in_its_layer_and_the_mix_weights_sum_to_1():
  rng = np.random.default_rng(0)
  n, dim, num_classes = 600, 16, 3
  labels = rng.integers(0, num_classes, n)
  x = rng.normal(size=(4, n, dim)).astype(np.float32)     # Layers 0..3: noise,
  x[2, :, :num_classes] += 3.0 * np.eye(num_classes)[labels]   # but layer 2 knows the label.
  result = scalar_mix.probe(x, labels, num_classes, seed=0, cfg=_FAST)
  weights = np.array(result['mix_weights'])
  assert abs(weights.sum() - 1.0) < 1e-5 and (weights > 0).all()
  assert int(np.argmax(weights)) == 2 and weights[2] > 2 * max(np.delete(weights, 2))
  assert int(np.argmax(result['layer_accuracy'])) == 2
  assert result['layer_accuracy'][2] > 0.8 and max(np.delete(result['layer_accuracy'], 2)) < 0.5
  assert result['mix_accuracy'] > 0.8 and 1.5 < result['expected_layer'] < 2.5
  assert result['examples'] == {'train': 420, 'dev': 60, 'test': 120}


def _words(texts):
  return [t.split() for t in texts]


@pytest.mark.parametrize('name', tasks.TASKS)
def test_built_in_tasks_are_balanced_and_labelled_as_their_names_say(name):
  task = tasks.make(name, seed=1, count_pieces=_words, max_pieces=30, examples=600)
  counts = np.bincount(task.labels, minlength=task.num_classes)
  assert (counts == counts[0]).all() and counts[0] >= min(50, 600 // task.num_classes)
  assert len(task.texts) == counts.sum() <= 600
  again = tasks.make(name, seed=1, count_pieces=_words, max_pieces=30, examples=600)
  assert again.texts == task.texts and (again.labels == task.labels).all()   # Same seed, same.
  if name == 'sentence_length':
    lengths = np.array([len(t.split()) for t in task.texts])
    assert lengths.max() <= 30
    bins = [lengths[task.labels == c] for c in range(task.num_classes)]
    assert all(a.max() < b.min() for a, b in zip(bins, bins[1:]))   # Ordered, disjoint bins.
  if name == 'word_content':
    for text, label in zip(task.texts, task.labels):
      held = {w.lower() for w in tasks._WORD.findall(text)} & set(task.label_names)
      assert held == {task.label_names[label]}
  if name == 'bigram_shift':
    originals = set(tasks._sentences())
    for text, label in zip(task.texts, task.labels):
      assert (text in originals) == (label == 0)
  if name == 'docstring_package':
    assert task.num_classes == 8 and 'asyncio' in task.label_names


def test_unknown_task_is_refused_with_the_known_ones():
  with pytest.raises(tasks.TaskError, match='built-in tasks: sentence_length, word_content'):
    tasks.make('parse_depth', 0, _words, 30)


def _train(prepared, tmp_path_factory, name: str, changes: dict) -> str:
  """A micro run without dropout on the test corpus (stdlib docstrings), with `changes`
  ({'train.num_steps': 100, ...}) to its config: its workdir."""
  config = copy.deepcopy(prepared[0])
  config.model.dropout_rate = 0.0
  for key, value in changes.items():
    section, field = key.split('.')
    config[section][field] = value
  workdir = str(tmp_path_factory.mktemp(name))
  run_training(config, workdir)
  return workdir


@pytest.fixture(scope='module')
def pretrained(prepared, tmp_path_factory):
  """A micro run trained for 100 steps."""
  return _train(prepared, tmp_path_factory, 'probe_run', {
      'train.num_steps': 100, 'train.warmup_steps': 10, 'train.log_every': 50,
      'train.eval_every': 100, 'train.checkpoint_every': 100})


def _evaluate(workdir: str, task: str, examples: int, monkeypatch) -> tuple[dict, dict]:
  """evaluate_run on one task, 2 seeds, `examples` examples: (the report, the task's row)."""
  monkeypatch.setattr(tasks, 'TASK_EXAMPLES', examples)
  report = runs.evaluate_run(workdir, seeds=2, task_names=(task,), cfg=_FAST, log=lambda s: None)
  return report, report['tasks'][0]


@pytest.mark.slow
def test_evaluate_compares_the_run_with_a_random_init_of_its_shape_per_seed(pretrained,
                                                                           monkeypatch):
  report, row = _evaluate(pretrained, 'docstring_package', 800, monkeypatch)
  assert row['examples'] == 800 and row['num_classes'] == 8 and len(row['best_single_layer']) == 2
  for kind in ('run', 'random'):
    scores = row[kind]['seeds']
    assert len(scores) == 2 and all(0.125 < s <= 1 for s in scores)   # Above chance.
    assert row[kind]['mean'] == pytest.approx(np.mean(scores))
  table = runs.format_evaluation(report)
  assert f'| docstring_package | 8 | 0.125 | {row["run"]["mean"]:.3f} ± ' in table
  from mlm_jax.training import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  run = workdir_lib.load(pretrained)
  fresh = features.random_params(run.model_cfg, seed=0)
  token = ('encoder', 'embeddings', 'token', 'embedding')
  trained_table, fresh_table = run.params, fresh
  for key in token:
    trained_table, fresh_table = trained_table[key], fresh_table[key]
  assert fresh_table.shape == trained_table.shape and not np.allclose(fresh_table, trained_table)


@pytest.mark.slow
def test_probe_run_writes_its_report_and_plot(pretrained, tmp_path, monkeypatch):
  monkeypatch.setattr(tasks, 'TASK_EXAMPLES', 600)
  report = runs.probe_run(pretrained, 'bigram_shift', seed=0, cfg=_FAST)
  assert len(report['layer_accuracy']) == len(report['mix_weights']) == 3   # Embeddings + 2.
  stem = runs.write_probe(report, str(tmp_path))
  assert os.path.getsize(stem + '.png') > 10_000
  assert json.load(open(stem + '.json'))['task'] == 'bigram_shift'
  text = runs.format_probe(report)
  assert 'expected layer' in text and text.count('\n') >= 5


@pytest.mark.slow
def test_features_are_per_layer_means_over_real_tokens(pretrained):
  from mlm_jax.training import workdir as workdir_lib  # pylint: disable=import-outside-toplevel
  run = workdir_lib.load(pretrained)
  inputs, cut = features.encode(run.tokenizer, ['A short one.', 'word ' * 100], 32)
  assert cut == 1 and inputs['attention_mask'][0].sum() < 32 == inputs['attention_mask'][1].sum()
  pooled = features.mean_pooled_layers(run.model_cfg, run.params, inputs)
  assert pooled.shape == (3, 2, 32)
  alone = features.mean_pooled_layers(run.model_cfg, run.params,
                                      {k: v[:1] for k, v in inputs.items()})
  np.testing.assert_allclose(alone[:, 0], pooled[:, 0], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_commands_refuse_a_directory_that_is_not_a_run(tmp_path):
  for command in (['mlm_jax.probe', '--task=bigram_shift'], ['mlm_jax.probe_suite']):
    bad = subprocess.run([sys.executable, '-m', command[0], f'--workdir={tmp_path}', *command[1:]],
                         cwd=REPO, capture_output=True, text=True, timeout=300)
    assert bad.returncode == 2, bad.stderr[-2000:]
    assert f'error: {tmp_path} is not a training workdir (no config.json).' in bad.stderr


@pytest.fixture(scope='module')
def pretrained_modern(prepared, tmp_path_factory):
  """A micro ModernBERT trained for 400 steps."""
  return _train(prepared, tmp_path_factory, 'probe_modern', {
      'model.variant': 'modern', 'model.layer_norm_eps': 1e-5, 'train.adam_b2': 0.98,
      'train.learning_rate': 5e-3, 'train.batch_size': 32, 'train.num_steps': 400,
      'train.warmup_steps': 20, 'train.log_every': 100, 'train.eval_every': 400,
      'train.checkpoint_every': 400})


@pytest.mark.slow
def test_pretrained_encoder_beats_its_random_init_on_sentence_length(pretrained_modern,
                                                                     monkeypatch):
  # Where the figures over 3 seeds and all tasks live: docs/probing.md.
  report, row = _evaluate(pretrained_modern, 'sentence_length', 1200, monkeypatch)
  assert report['checkpoint_step'] == 400
  assert all(r > f for r, f in zip(row['run']['seeds'], row['random']['seeds'])), row
  assert row['run']['mean'] - row['random']['mean'] > 0.03, row
