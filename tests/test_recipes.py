"""configs/recipes/: every recipe validates on 1 and 4 devices, its published phases are the ones
docs/recipes.md states, its batch and learning-rate warm-ups are the published trainer's
(replayed from the yamls' figures), the FlexBERT recipes keep documents apart, and the tiny
ModernBERT recipe covers what the CPU run must show (lengths, masking rates and a batch that
change); the smoke variants train through every phase."""

import importlib
import math
import re

import numpy as np
import pytest

from configs import bert_tiny
from configs import tiny
from configs.recipes import ettin
from configs.recipes import mmbert_languages
from mlm_jax.config import checks
from mlm_jax.config import phases
from mlm_jax.data import mixture
from tests.conftest import REPO

RECIPES = ('bert', 'roberta', 'modernbert', 'ettin', 'mmbert')
# The recipes whose tiny variant has configs/tiny.py's model; the others bert_tiny.py's.
MODERN = ('modernbert', 'ettin', 'mmbert')
SHAPE_FIELDS = ('variant', 'num_layers', 'hidden_size', 'num_heads', 'intermediate_size')
# Every published variant, as docs/recipes.md's table names it (FILE.py or FILE.py:ARG).
PUBLISHED = ('bert.py', 'roberta.py', 'modernbert.py', 'modernbert.py:large', 'mmbert.py',
             'mmbert.py:small') + tuple(f'ettin.py:{size}' for size in ettin.SIZES)
FLEXBERT = tuple(p for p in PUBLISHED if p.split('.')[0] in MODERN)


def _config(name: str, arg: str = ''):
  return importlib.import_module(f'configs.recipes.{name}').get_config(arg)


def _published(variant: str):
  """A published variant by its docs name, 'ettin.py:400m'."""
  name, _, arg = variant.partition(':')
  return _config(name.removesuffix('.py'), arg)


@pytest.mark.parametrize('num_devices', [1, 4])
@pytest.mark.parametrize('arg', ['', 'tiny', 'smoke'])
@pytest.mark.parametrize('name', RECIPES)
def test_every_variant_validates_on_one_h100_and_a_v5p_8(name, arg, num_devices):
  checks.validate(_config(name, arg), num_devices, check_paths=False)


@pytest.mark.parametrize('variant', [p for p in PUBLISHED if ':' in p])
def test_every_published_size_loads_and_validates(variant):
  config = _published(variant)
  for num_devices in (1, 4):
    checks.validate(config, num_devices, check_paths=False)


def test_the_ettin_sizes_have_their_published_shapes():
  """pretraining/README.md's table of Ettin's sizes: layers, width, GeGLU width, heads."""
  table = {'17m': (7, 256, 384, 4), '32m': (10, 384, 576, 6), '68m': (19, 512, 768, 8),
           '150m': (22, 768, 1152, 12), '400m': (28, 1024, 2624, 16),
           '1b': (28, 1792, 3840, 28)}
  assert set(table) == set(ettin.SIZES)
  for size, shape in table.items():
    m = _config('ettin', size).model
    assert (m.num_layers, m.hidden_size, m.intermediate_size, m.num_heads) == shape, size
  assert _config('ettin').to_dict() == _config('ettin', '150m').to_dict()


@pytest.mark.parametrize('size', list(ettin.SIZES))
def test_ettin_reads_a_chunk_of_one_document_a_row_in_every_phase(size):
  """split_dataset_into_chunks -m 512 -a 128 --backfill --backfill_no_duplicates, unpacked
  (sequence_packing: false); ModernBERT and mmBERT pack."""
  for phase in phases.Plan(_config('ettin', size)).phases:
    d = phase.config.data
    assert (d.row_layout, d.chunk_min_tokens, d.chunk_drop_tokens) == (
        'document_chunks', 512, 128), phase.name
  for name in ('modernbert', 'mmbert'):
    assert all(p.config.data.row_layout == 'packed' for p in phases.Plan(_config(name)).phases)


def test_ettin_fill_counts_real_tokens():
  """`SIZE,fill=F`: rows a share F real make every phase and the warm-up 1/F as many steps, as
  Ettin's trainer counts only real tokens; a fill outside (0, 1] is one line."""
  full, half = phases.Plan(_config('ettin', '68m')), phases.Plan(_config('ettin', '68m,fill=0.5'))
  for a, b in zip(full.phases, half.phases):
    assert b.end_step - b.start_step == pytest.approx(2 * (a.end_step - a.start_step), abs=2)
  assert half.phases[0].config.train.warmup_steps == pytest.approx(
      2 * full.phases[0].config.train.warmup_steps, abs=2)
  for bad in ('68m,fill=0', '68m,fill=1.5', '68m,fill=x'):
    with pytest.raises(ValueError, match=r"must be fill=F with 0 < F <= 1"):
      _config('ettin', bad)


@pytest.mark.parametrize('variant', FLEXBERT)
def test_flexbert_recipes_keep_documents_apart_and_drop_the_attention_output(variant):
  """padding: unpadded runs attention per cu_seqlens sequence, with rotary positions from 0 in
  each (ModernBERT and mmBERT pack documents so; Ettin's rows are single documents);
  attn_out_dropout_prob: 0.1. Every phase keeps both."""
  for phase in phases.Plan(_published(variant)).phases:
    m = phase.config.model
    assert m.document_mask and m.restart_positions, phase.name
    assert m.attention_output_dropout_rate == 0.1
    assert m.dropout_rate == m.attention_dropout_rate == 0.0


@pytest.mark.parametrize('size', ['', 'small'])
def test_mmbert_draws_each_language_at_its_share_of_the_published_phase_data(size):
  config = _config('mmbert', ','.join(filter(None, [size, 'data=/mnt/mm'])))
  checks.validate(config, 4, check_paths=False)
  assert config.data.sources[0]['corpus'].startswith('/mnt/mm/pretrain/')
  plan = phases.Plan(config)
  assert [len(p.config.data.sources) for p in plan.phases] == [61, 110, 110]
  # statistics/language_counts.csv counts the phases' data (its columns sum to them), which
  # mmBERT sampled at its exponents already: drawn in proportion, with no second temperature.
  for phase, column, total in zip(plan.phases, mmbert_languages.PHASES, (1.989e12, 6.008e11,
                                                                          1.044e11)):
    sources = phase.config.data.sources
    assert phase.config.data.temperature is None
    counts = mmbert_languages.COUNTS[column]
    assert sum(counts.values()) == pytest.approx(total, rel=1e-3)
    shares = mixture.shares([s['weight'] for s in sources], [1] * len(sources), 0.0)
    expected = np.array([counts[s['name']] for s in sources], float)
    np.testing.assert_allclose(shares, expected / expected.sum())
  # English holds 34.5% of the pretraining data and Xhosa 0.0095%.
  first = {s['name']: s['weight'] for s in plan.phases[0].config.data.sources}
  assert first['eng'] / sum(first.values()) == pytest.approx(0.3451, abs=1e-4)
  assert first['xho'] / sum(first.values()) == pytest.approx(9.5e-5, abs=1e-6)


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


def _rows(heading: str) -> list[tuple[str, str]]:
  """(variant, the rest of its row) of each table row of docs/recipes.md's `heading` section."""
  text = (REPO / 'docs' / 'recipes.md').read_text()
  section = text.split(f'\n## {heading}\n', 1)[1].split('\n## ', 1)[0]
  return re.findall(r'^\| `(\w+\.py(?::\w+)?)` \|(.*)\|$', section, re.M)


def _documented() -> dict[str, dict[str, list[str]]]:
  """docs/recipes.md's table of the published recipes: variant -> column -> a cell per phase."""
  rows = _rows('The published recipes')
  columns = ('phases', 'tokens', 'T', 'masking', 'schedule', 'batch', 'optimizer')
  table = {}
  for name, rest in rows:
    cells = [c.strip() for c in rest.split('|')]
    assert len(cells) == len(columns), f'docs/recipes.md: the row of {name} has {len(cells)} cells'
    table[name] = {col: cell.split(' / ') for col, cell in zip(columns, cells)}
  return table


def test_the_docs_table_has_a_row_per_published_variant():
  assert sorted(_documented()) == sorted(PUBLISHED)


@pytest.mark.parametrize('name', PUBLISHED)
def test_the_published_phases_are_the_ones_docs_recipes_md_states(name):
  row = _documented()[name]
  plan = phases.Plan(_published(name))
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


# ------------------------------------------------- warm-ups against the published trainer

# Each FlexBERT variant's warm-ups as its yaml gives them: device_train_microbatch_size and
# batch_size_warmup_min_size (rows per GPU; 0: no batch warm-up), the GPUs the run had,
# global_train_batch_size, batch_size_warmup_tokens and t_warmup (tokens).
YAMLS = {
    'modernbert.py': dict(micro=96, gpus=8, batch=4608, ramp=50e9, lr=3e9),
    'modernbert.py:large': dict(micro=56, gpus=8, batch=4928, ramp=10e9, lr=2e9),
    'mmbert.py': dict(micro=48, gpus=8, batch=4608, ramp=60e9, lr=3e9),
    'mmbert.py:small': dict(micro=48, gpus=8, batch=4608, ramp=100e9, lr=4e9),
    # sequence_packing: false: bert24's loader never warms the batch up.
    **{f'ettin.py:{size}': dict(micro=0, gpus=4, batch=4608, ramp=0, lr=s['warmup'])
       for size, s in ettin.SIZES.items()},
}


def flexbert_warmups(micro: int, gpus: int, batch: int, ramp: float, lr: float,
                     seq_len: int = 1024) -> dict[str, int]:
  """The published run's first global batch, the steps its batch warm-up takes and the steps
  until t_warmup tokens: AnswerDotAI/ModernBERT src/sequence_packer.py's
  BatchSizeWarmupScheduler replayed on each GPU (sizes counted in its micro-batches, from 1 to
  the full batch, each held for as many steps; its token count is the GPU's own), full rows."""
  full = batch // gpus // max(micro, 1)
  if not micro or not ramp:
    return {'start': batch, 'ramp_steps': 0, 'lr_steps': math.ceil(lr / (batch * seq_len))}
  per_gpu = math.ceil(ramp / gpus)
  per_unit = per_gpu / sum(range(1, full))
  thresholds = np.ceil(per_unit * np.cumsum(np.arange(1, full)))
  tokens = steps = 0
  lr_steps = None
  while True:
    size = 1 + int(np.searchsorted(thresholds, tokens, side='right')) if tokens < per_gpu else full
    if lr_steps is None and tokens * gpus >= lr:
      lr_steps = steps
    if size == full:
      break
    tokens, steps = tokens + size * micro * seq_len, steps + 1
  ramp_steps = steps
  if lr_steps is None:
    lr_steps = steps + math.ceil((lr - tokens * gpus) / (batch * seq_len))
  return {'start': micro * gpus, 'ramp_steps': ramp_steps, 'lr_steps': lr_steps}


def _ours(config) -> dict[str, int]:
  """Our first global batch, batch warm-up steps and learning-rate warm-up steps."""
  plan = phases.Plan(config)
  full = plan.phases[0].config.train.batch_size
  steps = np.arange(plan.phases[0].end_step)
  ramp = int(np.argmax(plan.batch_size(steps) == full))
  return {'start': int(plan.batch_size(0)), 'ramp_steps': ramp,
          'lr_steps': config.train.warmup_steps}


def _documented_warmups() -> dict[str, list[str]]:
  """docs/recipes.md's warm-up table: variant -> its cells."""
  return {name: [c.strip() for c in cells.split('|')] for name, cells in _rows('Warm-ups')}


def test_the_published_trainer_replays_modernberts_warm_ups():
  """ModernBERT-base on 8 GPUs: 1 to 5 micro-batches of 96 rows per GPU, then 6 (4,608 rows);
  each GPU's 6.25B warm-up tokens give each size 4,238-4,239 steps, 21,194 in all, and 3B
  tokens fall in the first size's, at step 3,815 (768 rows of 1,024 a step)."""
  assert flexbert_warmups(**YAMLS['modernbert.py']) == {'start': 768, 'ramp_steps': 21194,
                                                         'lr_steps': 3815}


@pytest.mark.parametrize('variant', FLEXBERT)
def test_batch_and_learning_rate_warm_ups_are_the_published_ones(variant):
  """The first batch is the yaml's per-GPU rows times its GPUs, the last the full batch, the
  warm-up the yaml's tokens, and the learning rate peaks at its t_warmup tokens, at the published
  trainer's steps (each batch size held for as many steps); docs/recipes.md states them."""
  yaml, config = YAMLS[variant], _published(variant)
  published, ours = flexbert_warmups(**yaml), _ours(config)
  assert ours == published
  train = config.train
  assert train.batch_warmup_tokens == yaml['ramp'] and train.batch_size == yaml['batch']
  plan = phases.Plan(config)
  if yaml['ramp']:  # The ramp ends within a step of its tokens.
    assert yaml['ramp'] - 1024 * yaml['batch'] < plan.tokens_before(ours['ramp_steps']) \
        <= yaml['ramp'] + 1024 * yaml['batch']
  steps = train.warmup_steps
  assert plan.tokens_before(steps - 1) < yaml['lr'] <= plan.tokens_before(steps)
  row = _documented_warmups()[variant]
  stated = [_integer(x) for x in re.findall(r'[\d,]+', row[-1])]
  assert stated == [published['ramp_steps'], published['lr_steps']], row


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
