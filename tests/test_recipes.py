"""configs/recipes/: every recipe validates on 1 and 4 devices, its published phases are the ones
docs/recipes.md states, and the tiny ModernBERT recipe covers what the CPU run must show
(lengths, masking rates and a batch that change); the smoke variants train through every
phase."""

import importlib
import re

import numpy as np
import pytest

from configs import bert_tiny
from configs import tiny
from mlm_jax.config import checks
from mlm_jax.config import phases
from tests.conftest import REPO

RECIPES = ('bert', 'roberta', 'modernbert', 'ettin', 'mmbert')
# The recipes whose tiny variant has configs/tiny.py's model; the others bert_tiny.py's.
MODERN = ('modernbert', 'ettin', 'mmbert')
SHAPE_FIELDS = ('variant', 'num_layers', 'hidden_size', 'num_heads', 'intermediate_size')


def _config(name: str, arg: str = ''):
  return importlib.import_module(f'configs.recipes.{name}').get_config(arg)


@pytest.mark.parametrize('num_devices', [1, 4])
@pytest.mark.parametrize('arg', ['', 'tiny', 'smoke'])
@pytest.mark.parametrize('name', RECIPES)
def test_every_variant_validates_on_one_h100_and_a_v5p_8(name, arg, num_devices):
  checks.validate(_config(name, arg), num_devices, check_paths=False)


def test_mmbert_takes_its_data_root_as_an_argument():
  config = _config('mmbert', 'data=/mnt/mm')
  checks.validate(config, 4, check_paths=False)
  assert config.data.sources[0]['corpus'].startswith('/mnt/mm/pretrain/')
  plan = phases.Plan(config)
  # More languages each phase, drawn flatter (mmBERT's exponents 0.7, 0.5, 0.3 as 1/tau).
  assert [len(p.config.data.sources) for p in plan.phases] == [61, 110, 110]
  np.testing.assert_allclose([p.config.data.temperature for p in plan.phases],
                             [1 / 0.7, 2.0, 1 / 0.3])


@pytest.mark.parametrize('name', RECIPES)
def test_an_unknown_argument_names_the_choices(name):
  with pytest.raises(ValueError, match=r"takes '', .*'tiny' or 'smoke'"):
    _config(name, 'huge')


# ------------------------------------------------------- docs/recipes.md's table

_SUFFIX = {'T': 1e12, 'B': 1e9, 'M': 1e6}


def _tokens(cell: str) -> float:
  number = re.fullmatch(r'([\d.]+)([TBM])', cell.strip())
  assert number, f'a token count such as 1.7T or 250B, not {cell!r}'
  return float(number.group(1)) * _SUFFIX[number.group(2)]


def _integer(text: str) -> int:
  return int(text.replace(',', ''))


def _documented() -> dict[str, dict[str, list[str]]]:
  """docs/recipes.md's table of the published recipes: recipe -> column -> a cell per phase."""
  text = (REPO / 'docs' / 'recipes.md').read_text()
  rows = re.findall(r'^\| `(\w+)\.py` \|(.*)\|$', text, re.M)
  columns = ('phases', 'tokens', 'T', 'masking', 'schedule', 'batch', 'optimizer')
  table = {}
  for name, rest in rows:
    cells = [c.strip() for c in rest.split('|')]
    assert len(cells) == len(columns), f'docs/recipes.md: the row of {name} has {len(cells)} cells'
    table[name] = {col: cell.split(' / ') for col, cell in zip(columns, cells)}
  return table


def test_the_docs_table_has_a_row_per_recipe():
  assert sorted(_documented()) == sorted(RECIPES)


@pytest.mark.parametrize('name', RECIPES)
def test_the_published_phases_are_the_ones_docs_recipes_md_states(name):
  row = _documented()[name]
  plan = phases.Plan(_config(name))
  described = plan.describe()
  assert [p['phase'] for p in described] == row['phases']
  for phase, tokens, t, rate, batch in zip(described, row['tokens'], row['T'], row['masking'],
                                           row['batch']):
    # The docs round to 3-4 significant digits; the plan ends a phase at a whole step.
    assert phase['tokens'] == pytest.approx(_tokens(tokens), rel=0.005), phase['phase']
    assert phase['seq_len'] == _integer(t)
    assert phase['select_rate'] == pytest.approx(float(rate.rstrip('%')) / 100)
    # 'a→b over N tokens' is the batch warm-up: the phase's full batch is b.
    full = re.search(r'([\d,]+)(?: over|$)', batch).group(1)
    assert phase['batch_size'] == _integer(full)
  optimizer = {'StableAdamW': 'stable_adamw', 'AdamW': 'adamw'}[row['optimizer'][0].split()[0]]
  assert {p['optimizer'] for p in described} == {optimizer}
  warmup = re.search(r'([\d,]+)→([\d,]+) over (\S+) tokens', row['batch'][0])
  if warmup:  # The warm-up's first batch and length as the docs state them.
    train = plan.phases[0].config.train
    assert train.batch_warmup_start == _integer(warmup.group(1))
    assert train.batch_warmup_tokens == _tokens(warmup.group(3))
    assert plan.batch_size(0) == train.batch_warmup_start


@pytest.mark.parametrize('name', ['modernbert', 'ettin', 'mmbert'])
def test_the_learning_rate_warms_up_over_the_first_3b_tokens(name):
  """The yamls give the warm-up in tokens (t_warmup: 3_000_000_000tok) while the batch grows."""
  config = _config(name)
  plan = phases.Plan(config)
  steps = config.train.warmup_steps
  assert plan.tokens_before(steps - 1) < 3e9 <= plan.tokens_before(steps)


# ---------------------------------------------------------------- tiny and smoke


@pytest.mark.parametrize('name', RECIPES)
def test_tiny_variants_keep_the_quick_start_model_tokenizer_and_corpus(name):
  config = _config(name, 'tiny')
  reference = (tiny if name in MODERN else bert_tiny).get_config()
  for field in SHAPE_FIELDS:
    value = config.model[field]
    if field == 'variant' and value == 'roberta':  # The BERT encoder in RoBERTa's layout.
      value = 'bert'
    assert value == reference.model[field], field
  assert config.tokenizer.to_dict() == reference.tokenizer.to_dict()
  assert config.data.corpus == '' and not config.data.sources


@pytest.mark.parametrize('name', RECIPES)
def test_smoke_variants_are_the_tiny_phases_cut_to_a_few_steps(name):
  tiny_plan, smoke_plan = phases.Plan(_config(name, 'tiny')), phases.Plan(_config(name, 'smoke'))
  assert len(smoke_plan.phases) == len(tiny_plan.phases)
  for cut, full in zip(smoke_plan.phases, tiny_plan.phases):
    assert 2 <= cut.num_steps <= 4
    assert cut.name == full.name
    assert cut.config.data.seq_len == full.config.data.seq_len
    assert cut.config.masking.select_rate == full.config.masking.select_rate
    assert cut.config.train.schedule == full.config.train.schedule


def test_modernbert_tiny_changes_length_and_masking_rate_and_warms_up_its_batch():
  config = _config('modernbert', 'tiny')
  plan = phases.Plan(config)
  lengths = [p.config.data.seq_len for p in plan.phases]
  rates = [p.config.masking.select_rate for p in plan.phases]
  assert len(plan.phases) >= 3
  assert len(set(lengths)) >= 2 and len(set(rates)) >= 2
  # The global layers' rotary base goes up with the length, as ModernBERT's.
  longer = lengths.index(max(lengths))
  assert (plan.phases[longer].config.model.global_rope_theta
          > plan.phases[0].config.model.global_rope_theta)
  # The batch grows from 8 rows to 16, a micro-batch at a time, inside the first phase.
  batches = plan.batch_size(np.arange(plan.phases[0].end_step))
  assert batches[0] == 8 and batches[-1] == 16 and set(batches) == {8, 16}
  # StableAdamW; warm-up-stable ('constant') phases, then a 1-sqrt decay.
  assert {p.config.train.optimizer for p in plan.phases} == {'stable_adamw'}
  assert [p.config.train.schedule for p in plan.phases][:-1] == ['constant'] * (len(lengths) - 1)
  assert plan.phases[-1].config.train.schedule == 'decay'
  assert plan.phases[-1].config.train.decay_shape == '1-sqrt'
  # About 4M tokens, as its docstring states: a few minutes on two cores.
  assert 3.5e6 <= plan.tokens_before(plan.num_steps) <= 4.5e6


@pytest.mark.slow
@pytest.mark.parametrize('name', RECIPES)
def test_every_phase_of_every_recipe_trains_on_a_cpu(name, tmp_path):
  """The smoke variants (the tiny phases cut to a few steps) train through every boundary."""
  import json
  import os

  from tests.conftest import run_training
  config = _config(name, 'smoke')
  plan = phases.Plan(config)
  summary = run_training(config, str(tmp_path / name))
  assert summary['step'] == plan.num_steps
  with open(os.path.join(tmp_path, name, 'metrics.jsonl')) as f:
    records = [json.loads(line) for line in f]
  trained = [r for r in records if 'loss' in r]
  if plan.phased:  # RoBERTa's recipe is one run.
    assert [r['phase'] for r in trained] == [plan.phase_at(r['step'] - 1).name for r in trained]
    assert {r['phase'] for r in trained} == {p.name for p in plan.phases}
  assert all(np.isfinite(r['loss']) for r in trained)
  assert any('eval_mask_accuracy' in r for r in records)
