"""What a researcher looks at: TensorBoard, curves, profiles, layers, summary."""

import glob
import gzip
import json
import os
import pathlib
import shutil
import subprocess
import sys

import flax.linen
import jax
import numpy as np
import pytest

from mlm_jax import model as model_lib
from mlm_jax.analysis import layer_report
from mlm_jax.analysis import plot
from mlm_jax.model import flops
from mlm_jax.training import metrics
from mlm_jax.training import summary as run_summary
from tests.conftest import model_config
from tests.conftest import run_training

REPO = pathlib.Path(__file__).resolve().parent.parent
PNG_MAGIC = b'\x89PNG\r\n\x1a\n'


def _records(workdir):
  with open(os.path.join(workdir, 'metrics.jsonl')) as f:
    return [json.loads(line) for line in f]


def _config(prepared):
  config, _ = prepared
  config = config.copy_and_resolve_references()
  config.profile.start_step = 2
  config.profile.num_steps = 3
  return config


@pytest.fixture(scope='module')
def run(prepared, tmp_path_factory):
  """One 8-step micro run (steps 2-4 profiled), shared by the tests below."""
  config = _config(prepared)
  workdir = str(tmp_path_factory.mktemp('researcher') / 'run_a')
  summary = run_training(config, workdir)
  return config, workdir, summary


def _scalars(logdir):
  from tensorboard.backend.event_processing import event_accumulator
  acc = event_accumulator.EventAccumulator(logdir, size_guidance={'scalars': 0})
  acc.Reload()
  return acc


@pytest.mark.slow
def test_tensorboard_has_every_logged_scalar_at_its_step_and_the_hparams(run):
  config, workdir, _ = run
  acc = _scalars(os.path.join(workdir, 'tb'))
  tags = set(acc.Tags()['scalars'])
  records = _records(workdir)
  expected = {metrics.tensorboard_tag(k) for r in records for k, v in r.items()
              if k not in ('step', 'time') and isinstance(v, (int, float))}
  assert expected >= {'train/loss', 'train/mlm_accuracy', 'train/learning_rate',
                      'train/tokens_per_sec', 'train/tokens_seen', 'eval/loss',
                      'eval/mlm_accuracy', 'eval/baseline_accuracy', 'train/mask_accuracy',
                      'eval/mask_accuracy', 'eval/mask_baseline_accuracy', 'eval/kept_accuracy',
                      'eval/random_accuracy'}
  assert tags == expected  # Strings (the baseline token) are not scalars.
  assert [e.step for e in acc.Scalars('train/loss')] == [2, 4, 6, 8]
  assert [e.step for e in acc.Scalars('eval/mlm_accuracy')] == [4, 8]
  for r in records:
    for k, v in r.items():
      if k in ('step', 'time') or not isinstance(v, (int, float)):
        continue
      (value,) = [e.value for e in acc.Scalars(metrics.tensorboard_tag(k)) if e.step == r['step']]
      assert value == pytest.approx(v, rel=1e-6)

  from tensorboard.plugins.hparams import plugin_data_pb2
  content = acc.PluginTagToContent('hparams')
  start = plugin_data_pb2.HParamsPluginData.FromString(
      content['_hparams_/session_start_info']).session_start_info
  assert start.hparams['model.hidden_size'].number_value == config.model.hidden_size
  assert start.hparams['train.learning_rate'].number_value == config.train.learning_rate
  assert start.hparams['data.corpus'].string_value == config.data.corpus


@pytest.mark.slow
def test_resumed_run_counts_all_tokens_and_tensorboard_hides_the_lost_steps(run, tmp_path):
  config, workdir, summary = run
  resumed = str(tmp_path / 'resumed')
  shutil.copytree(workdir, resumed)
  shutil.rmtree(os.path.join(resumed, 'checkpoints', '8'))
  config = config.copy_and_resolve_references()
  config.profile.num_steps = 0
  config.profile.peak_tflops = 1.0  # An override gives an MFU even on a CPU.
  again = run_training(config, resumed)
  assert (again['start_step'], again['step']) == (4, 8)
  # Data and masks are functions of (seed, step): the same tokens again.
  assert again['tokens_seen_from_step'] == 0
  assert again['tokens_seen'] == summary['tokens_seen']
  assert again['mfu'] == pytest.approx(
      again['mean_tokens_per_sec'] * again['flops_per_token'] / (1e12 * jax.device_count()))
  acc = _scalars(os.path.join(resumed, 'tb'))
  assert [e.step for e in acc.Scalars('train/loss')] == [2, 4, 6, 8]
  assert [e.step for e in acc.Scalars('eval/loss')] == [4, 8]
  series = metrics.read_metrics(resumed)
  assert sorted(series['loss']) == [2, 4, 6, 8]
  assert series['loss'][8] == _records(resumed)[-2]['loss']


def test_read_metrics_keeps_the_later_attempt(tmp_path):
  lines = [{'step': 2, 'loss': 5.0}, {'step': 4, 'loss': 4.0}, {'step': 4, 'eval_loss': 4.5},
           {'step': 6, 'loss': 3.0}, {'step': 8, 'loss': 2.0}, {'step': 8, 'eval_loss': 2.5},
           # Resumed from step 4, stopped at 7: the old 8s must not survive.
           {'step': 6, 'loss': 3.1}, {'step': 7, 'loss': 2.9, 'eval_baseline_token': 'x'}]
  (tmp_path / 'metrics.jsonl').write_text(''.join(json.dumps(r) + '\n' for r in lines))
  series = metrics.read_metrics(str(tmp_path))
  assert series['loss'] == {2: 5.0, 4: 4.0, 6: 3.1, 7: 2.9}
  assert series['eval_loss'] == {4: 4.5}
  assert 'eval_baseline_token' not in series


def _assert_png(path):
  with open(path, 'rb') as f:
    head = f.read(8)
  assert head == PNG_MAGIC and os.path.getsize(path) > 5000, path


@pytest.mark.slow
def test_plots_of_one_run(run):
  _, workdir, _ = run
  paths = plot.plot_runs([workdir])
  assert sorted(os.path.basename(p) for p in paths) == [
      'learning_rate.png', 'loss.png', 'mask_accuracy.png', 'mlm_accuracy.png',
      'tokens_per_sec.png']
  assert all(os.path.dirname(p) == os.path.join(workdir, 'plots') for p in paths)
  for p in paths:
    _assert_png(p)


@pytest.mark.slow
def test_plot_command_overlays_two_runs(run, tmp_path):
  _, workdir, _ = run
  other = tmp_path / 'run_b'
  other.mkdir()
  shutil.copy(os.path.join(workdir, 'metrics.jsonl'), other / 'metrics.jsonl')
  out = tmp_path / 'plots'
  result = subprocess.run(
      [sys.executable, '-m', 'mlm_jax.plot', f'--workdir={workdir}', f'--workdir={other}',
       f'--out={out}'], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert result.returncode == 0, result.stderr[-2000:]
  assert sorted(os.listdir(out)) == [
      'learning_rate.png', 'loss.png', 'mask_accuracy.png', 'mlm_accuracy.png',
      'tokens_per_sec.png']
  for p in out.iterdir():
    _assert_png(str(p))
  assert plot.run_labels(['/x/a/run', '/x/b/run', '/y/c']) == ['a/run', 'b/run', 'y/c']


@pytest.mark.slow
def test_profile_holds_a_trace_of_the_profiled_steps(run):
  _, workdir, _ = run
  xplanes = glob.glob(os.path.join(workdir, 'profile', 'plugins', 'profile', '*', '*.xplane.pb'))
  assert len(xplanes) == 1 and os.path.getsize(xplanes[0]) > 0
  (trace,) = glob.glob(os.path.join(os.path.dirname(xplanes[0]), '*.trace.json.gz'))
  with gzip.open(trace) as f:
    events = json.load(f)['traceEvents']
  steps = {int(e['args']['step_num']) for e in events
           if e.get('name') == 'train' and 'step_num' in e.get('args', {})}
  assert steps == {2, 3, 4}


@pytest.mark.slow
def test_layer_report_has_one_row_per_layer(run):
  config, workdir, _ = run
  report = layer_report.layer_report(workdir)
  rows = report['layers']
  assert [r['layer'] for r in rows] == list(range(config.model.num_layers + 1))
  assert rows[0]['module'] == 'encoder/embeddings' and rows[-1]['module'] == 'encoder/layer_1'
  for r in rows:
    assert 0.0 <= r['mlm_accuracy'] <= 1.0 and np.isfinite(r['loss']) and r['num_masked'] > 0
  # The last layer is what training evaluates: same masks, same batches.
  last_eval = [r for r in _records(workdir) if 'eval_loss' in r][-1]
  assert rows[-1]['mlm_accuracy'] == pytest.approx(last_eval['eval_mlm_accuracy'], abs=1e-6)
  assert rows[-1]['loss'] == pytest.approx(last_eval['eval_loss'], rel=1e-4)
  assert rows[-1]['num_masked'] == last_eval['eval_num_masked']
  with open(os.path.join(workdir, 'layer_report.json')) as f:
    assert json.load(f)['layers'] == rows
  with open(os.path.join(workdir, 'layer_report.csv')) as f:
    assert len(f.read().strip().splitlines()) == len(rows) + 1
  _assert_png(os.path.join(workdir, 'layer_report.png'))
  table = layer_report.format_table(report)
  assert 'encoder/embeddings' in table and len(table.splitlines()) == len(rows) + 3
  one = layer_report.layer_report(workdir, max_batches=1)
  assert one['num_batches'] == 1 and one['layers'][0]['num_masked'] < rows[0]['num_masked']


@pytest.mark.slow
def test_all_layers_leaves_the_parameters_and_the_default_output_alone():
  cfg = model_config(vocab_size=300, padded_vocab_size=384, num_layers=2,
                              hidden_size=16, num_heads=2, intermediate_size=32,
                              max_position_embeddings=8)
  ids = np.arange(16, dtype=np.int32).reshape(2, 8) + 5
  batch = {'input_ids': ids, 'segment_ids': np.zeros_like(ids), 'attention_mask': np.ones_like(ids),
           'masked_positions': np.array([[1, 3], [2, 7]], np.int32)}
  model = model_lib.BertForMLM(cfg)
  params = flax.linen.unbox(model.init(jax.random.key(0), batch))
  names = {jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_leaves_with_path(params)}
  assert "['params']['encoder']['layer_1']['output_layer_norm']['scale']" in names
  assert len(names) == 2 + 3 + 2 * 16 + 5  # embeddings LN, tables, 2 blocks, head
  layers = model.apply(params, batch, method=model_lib.BertForMLM.all_layers)
  assert layers.shape == (3, 2, 8, 16)
  logits = model.apply(params, layers[-1], batch['masked_positions'],
                       method=model_lib.BertForMLM.mlm_logits)
  np.testing.assert_array_equal(logits, model.apply(params, batch))


@pytest.mark.slow
def test_summary_json(run):
  config, workdir, summary = run
  with open(os.path.join(workdir, 'summary.json')) as f:
    saved = json.load(f)
  assert saved == json.loads(json.dumps(summary))
  records = _records(workdir)
  train = [r for r in records if 'loss' in r]
  evals = [r for r in records if 'eval_loss' in r]
  assert summary['step'] == 8 and summary['start_step'] == 0 and summary['wall_time_s'] > 0
  # Real tokens: at most batch x T per step, and packing leaves little padding.
  full = 8 * config.train.batch_size * config.data.seq_len
  assert 0.9 * full < summary['tokens_seen'] <= full
  assert summary['tokens_seen'] == train[-1]['tokens_seen']
  assert summary['tokens_seen_from_step'] == 0
  assert summary['final_train_loss'] == train[-1]['loss']
  assert summary['final_train_mlm_accuracy'] == train[-1]['mlm_accuracy']
  assert summary['final_eval_loss'] == evals[-1]['eval_loss']
  assert summary['final_eval_mlm_accuracy'] == evals[-1]['eval_mlm_accuracy']
  assert summary['best_eval_mlm_accuracy'] == max(r['eval_mlm_accuracy'] for r in evals)
  assert summary['best_eval_step'] in (4, 8)
  assert summary['mean_tokens_per_sec'] > 0
  with open(os.path.join(workdir, 'config.json')) as f:
    padded_vocab = json.load(f)['resolved']['padded_vocab_size']
  assert summary['flops_per_token'] == flops.flops_per_token(
      num_layers=2, hidden_size=32, intermediate_size=64, seq_len=32, vocab_size=padded_vocab,
      max_predictions=6)
  # No known peak for a CPU: no invented MFU.
  assert summary['device_kind'] == 'cpu' and summary['mfu'] is None
  assert summary['peak_flops_per_device'] is None


def test_summary_counts_only_this_invocation_when_the_resume_step_was_not_logged():
  counters = run_summary.Counters()
  speed = counters.add_interval([{'num_tokens': 100}, {'num_tokens': 90}], untimed=1, seconds=2.0)
  assert speed == {'tokens_per_sec': 45.0, 'step_time_s': 2.0}  # The untimed step left out.
  assert run_summary.Counters().add_interval([{'num_tokens': 7}], untimed=1, seconds=0.0) == {}
  series = {'tokens_seen': {4: 400.0}, 'eval_mlm_accuracy': {4: 0.3, 8: 0.5, 12: 0.5}}
  assert run_summary.tokens_before(series, 4) == 400
  assert run_summary.tokens_before(series, 6) is None
  summary = run_summary.build(
      step=8, start_step=6, wall_time_s=1.0, counters=counters, earlier_tokens=None,
      series=series, flops_per_token=1.0, peak_flops_per_device=None, num_devices=1,
      device_kind='cpu', mfu=None)
  assert (summary['tokens_seen'], summary['tokens_seen_from_step']) == (190, 6)
  assert summary['mean_tokens_per_sec'] == 45.0  # The untimed step is left out.
  assert (summary['best_eval_mlm_accuracy'], summary['best_eval_step']) == (0.5, 8)
  assert summary['final_eval_mlm_accuracy'] == 0.5 and summary['final_train_loss'] is None


def test_flops_formula_and_peaks():
  # BERT-base, T=128, P=20, V=30522: the formula's terms by hand. The last
  # block's keys and values cover every token, the rest of it the P slots.
  L, d, f, T, V, P = 12, 768, 3072, 128, 30522, 20
  head = 6 * (d**2 + d * V) * P / T
  expected = (6 * (L - 1) * (4 * d**2 + 2 * d * f) + 6 * (2 * d**2 + (2 * d**2 + 2 * d * f) * P / T)
              + 12 * d * T * (L - 1 + P / T) + head)
  shape = dict(num_layers=L, hidden_size=d, intermediate_size=f, seq_len=T, vocab_size=V,
               max_predictions=P)
  assert flops.flops_per_token(**shape) == pytest.approx(expected)
  # Every block on all T rows, as Hugging Face's step computes it.
  assert flops.flops_per_token(**shape, last_block_rows=T) == pytest.approx(
      6 * L * (4 * d**2 + 2 * d * f) + 12 * L * d * T + head)
  assert flops.peak_flops_per_device('NVIDIA H100 80GB HBM3') == 989e12
  assert flops.peak_flops_per_device('NVIDIA A100-SXM4-40GB') == 312e12
  assert flops.peak_flops_per_device('TPU v4') == 275e12
  assert flops.peak_flops_per_device('TPU v5 lite') == 197e12
  assert flops.peak_flops_per_device('TPU v5p') == 459e12
  assert flops.peak_flops_per_device('cpu') is None
  assert flops.peak_flops_per_device('cpu', peak_tflops=2.5) == 2.5e12
  assert flops.mfu(1000.0, 1e9, 1e12, 2) == pytest.approx(0.5)
  assert flops.mfu(None, 1e9, 1e12, 1) is None and flops.mfu(1.0, 1e9, None, 1) is None


@pytest.mark.slow
def test_eval_reports_mask_slots_against_the_most_frequent_token(run):
  _, workdir, summary = run
  last = [r for r in _records(workdir) if 'eval_loss' in r][-1]
  for kind in ('mask', 'random', 'kept'):
    assert 0.0 <= last[f'eval_{kind}_accuracy'] <= 1.0
    assert 0.0 <= last[f'eval_{kind}_baseline_accuracy'] <= 1.0
  # The kinds split the masked slots: the overall figures are their weighted means.
  kinds = ('mask', 'random', 'kept')
  for overall, per_kind in (('eval_mlm_accuracy', 'eval_{}_accuracy'),
                            ('eval_baseline_accuracy', 'eval_{}_baseline_accuracy')):
    values = [last[per_kind.format(k)] for k in kinds]
    assert min(values) - 1e-6 <= last[overall] <= max(values) + 1e-6
  assert summary['final_eval_mask_accuracy'] == last['eval_mask_accuracy']
  if last['eval_mask_baseline_accuracy'] > 0:
    assert last['eval_context_ratio'] == pytest.approx(
        last['eval_mask_accuracy'] / last['eval_mask_baseline_accuracy'])
    assert summary['final_eval_context_ratio'] == last['eval_context_ratio']
