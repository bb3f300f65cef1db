"""Fine-tuning protocols as data: the grid, the seeds, the selection rule, the MNLI start.

A protocol says, per task, which grid cells run (every combination of its
learning rates, batch sizes, epochs, warm-up fractions and weight decays),
with which seeds, how a cell's seeds are summed up (median or mean), which
evaluation of a run counts (its best on dev, early stopping, or its last),
and which tasks start from the MNLI model. The cell chosen for a task is the
one whose summary of the task's score (tasks.score) over its seeds is
highest; a tie goes to the earlier cell of the grid.

What must stay true: every value of a published protocol names its source in
`sources` (a file of a repository at a commit, or a paper's section), and a
value its source does not give says so there; `sources` and `notes` are
written into results.json beside the numbers. Weight decay is AdamW's as
optax and torch apply it (multiplied by the learning rate); a source whose
optimizer decays otherwise is converted, and the conversion is stated.
`--protocol=FILE.json` reads a user's protocol with the same fields.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
from typing import Any

from mlm_jax.errors import ConfigError

AGGREGATES = ('median', 'mean')
WITHIN_RUN = ('best', 'last')

_BERT_REPO = 'google-research/bert@eedf571'
_FAIRSEQ = 'facebookresearch/fairseq@3d262bb2'
_FAIRSEQ_OLD = 'facebookresearch/fairseq@7b710acc'
_MODERNBERT = 'AnswerDotAI/ModernBERT@8c57a0f'


@dataclasses.dataclass(frozen=True)
class Grid:
  """The values a task's cells combine; weight decay as optax's and torch's AdamW take it."""

  learning_rates: tuple[float, ...]   # 0: fine-tuning's width rule (5e-5 x 768 / d, <= 1e-3).
  batch_sizes: tuple[int, ...]
  epochs: tuple[float, ...]
  warmup: tuple[float, ...] = (0.1,)  # Fractions of the steps, then linear decay to 0.
  weight_decay: tuple[float, ...] = (0.01,)

  def cells(self) -> list[Cell]:
    return [Cell(*values) for values in itertools.product(
        self.learning_rates, self.batch_sizes, self.epochs, self.warmup, self.weight_decay)]


@dataclasses.dataclass(frozen=True)
class Cell:
  """One point of a grid; with a seed and a task, one fine-tuning run."""

  learning_rate: float
  batch_size: int
  epochs: float
  warmup: float
  weight_decay: float

  @property
  def name(self) -> str:
    """A directory name: 'lr2e-05_bs32_ep3_wu0.1_wd0.01' ('lrauto' for the width rule)."""
    lr = f'{self.learning_rate:g}' if self.learning_rate else 'auto'
    return (f'lr{lr}_bs{self.batch_size}_ep{self.epochs:g}_wu{self.warmup:g}_'
            f'wd{self.weight_decay:g}')


@dataclasses.dataclass(frozen=True)
class Protocol:
  """A fine-tuning protocol (see the module docstring)."""

  name: str
  grid: Grid
  seeds: tuple[int, ...]
  aggregate: str = 'median'       # How a cell's seeds are summed up, and the cell chosen.
  within_run: str = 'best'        # 'best': a run's best evaluation on dev; 'last': its last.
  start_from_mnli: tuple[str, ...] = ()
  max_seq_len: int = 128          # Rows are cut to this (and the model's position table).
  adam_b1: float = 0.9
  adam_b2: float = 0.999
  adam_eps: float = 1e-6
  grad_clip_norm: float = 1.0     # 0: none.
  max_train_rows: int | None = None   # A training file longer is drawn down to this (seed 0).
  task_grids: dict[str, Grid] = dataclasses.field(default_factory=dict)
  sources: dict[str, str] = dataclasses.field(default_factory=dict)
  notes: tuple[str, ...] = ()

  def grid_for(self, task: str) -> Grid:
    return self.task_grids.get(task, self.grid)

  def cells(self, task: str) -> list[Cell]:
    return self.grid_for(task).cells()

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  def check(self) -> None:
    """ConfigError naming the first value that cannot run."""
    where = f'protocol {self.name!r}'
    if not self.seeds:
      raise ConfigError(f'{where}: no seeds.')
    if self.aggregate not in AGGREGATES or self.within_run not in WITHIN_RUN:
      raise ConfigError(f'{where}: aggregate must be one of {AGGREGATES} and within_run one of '
                        f'{WITHIN_RUN}.')
    for task, grid in {'': self.grid, **self.task_grids}.items():
      for field in dataclasses.fields(Grid):
        values = getattr(grid, field.name)
        if not values or any(v < 0 for v in values):
          raise ConfigError(f'{where}: {"task " + task + " " if task else ""}grid.{field.name}'
                            f'={list(values)} must name non-negative values.')
      if any(b <= 0 for b in grid.batch_sizes) or any(e <= 0 for e in grid.epochs):
        raise ConfigError(f'{where}: batch sizes and epochs must be positive.')
      if any(w >= 1 for w in grid.warmup):
        raise ConfigError(f'{where}: warm-up fractions must be below 1.')
    if self.max_seq_len < 8:
      raise ConfigError(f'{where}: max_seq_len={self.max_seq_len} must be at least 8.')


def _grid(**values: Any) -> Grid:
  return Grid(**{k: tuple(v) if isinstance(v, (list, tuple)) else (v,) for k, v in values.items()})


# Devlin et al., "BERT: Pre-training of Deep Bidirectional Transformers for Language
# Understanding", NAACL 2019 (arXiv:1810.04805), section 4.1, and the code that ran it.
BERT = Protocol(
    name='bert',
    grid=_grid(learning_rates=(5e-5, 4e-5, 3e-5, 2e-5), batch_sizes=32, epochs=3.0,
               warmup=0.1, weight_decay=0.01),
    seeds=(0,), aggregate='median', within_run='last', start_from_mnli=(), max_seq_len=128,
    adam_b1=0.9, adam_b2=0.999, adam_eps=1e-6, grad_clip_norm=1.0,
    sources={
        'learning_rates': 'Devlin et al. 2019, sec. 4.1: "we selected the best fine-tuning '
                          'learning rate (among 5e-5, 4e-5, 3e-5, and 2e-5) on the Dev set"',
        'batch_sizes': 'Devlin et al. 2019, sec. 4.1: "a batch size of 32"; '
                       f'{_BERT_REPO} run_classifier.py train_batch_size=32',
        'epochs': 'Devlin et al. 2019, sec. 4.1: "fine-tune for 3 epochs over the data for all '
                  f'GLUE tasks"; {_BERT_REPO} run_classifier.py num_train_epochs=3.0',
        'warmup': f'{_BERT_REPO} run_classifier.py warmup_proportion=0.1; optimization.py: '
                  'linear warm-up, then polynomial_decay(power=1.0) to 0',
        'weight_decay': f'{_BERT_REPO} optimization.py AdamWeightDecayOptimizer('
                        'weight_decay_rate=0.01, exclude_from_weight_decay=["LayerNorm", '
                        '"layer_norm", "bias"]), the decay multiplied by the learning rate',
        'adam': f'{_BERT_REPO} optimization.py beta_1=0.9, beta_2=0.999, epsilon=1e-6',
        'grad_clip_norm': f'{_BERT_REPO} optimization.py clip_by_global_norm(clip_norm=1.0)',
        'max_seq_len': f'{_BERT_REPO} run_classifier.py max_seq_length=128',
        'within_run': f'{_BERT_REPO} run_classifier.py evaluates the checkpoint training ends '
                      'with (do_eval after do_train); no early stopping',
        'seeds': 'Devlin et al. 2019 give no seeds: one run per cell for BERT-base; for '
                 'BERT-large "several random restarts", their number not stated; one seed here',
        'aggregate': 'one seed: its figure (the median of one)',
        'start_from_mnli': 'none: each task starts from the pretrained model (sec. 4.1)',
    },
    notes=('BERT\'s AdamWeightDecayOptimizer has no bias correction; optax\'s AdamW has.',
           'WNLI: BERT reports none (its GLUE submission predicted the majority class); the '
           'grid above runs on it too.'))

# Liu et al., "RoBERTa: A Robustly Optimized BERT Pretraining Approach" (arXiv:1907.11692),
# sec. 5.1 and appendix C (the sweep), and fairseq's examples/roberta (the optimizer's values).
ROBERTA = Protocol(
    name='roberta',
    grid=_grid(learning_rates=(1e-5, 2e-5, 3e-5), batch_sizes=(16, 32), epochs=10.0,
               warmup=0.06, weight_decay=0.1),
    seeds=(0, 1, 2, 3, 4), aggregate='median', within_run='best',
    start_from_mnli=('rte', 'mrpc', 'stsb'), max_seq_len=512,
    adam_b1=0.9, adam_b2=0.98, adam_eps=1e-6, grad_clip_norm=0.0,
    sources={
        'learning_rates': 'Liu et al. 2019, sec. 5.1 and appendix C (table 10): a sweep over '
                          'learning rates 1e-5, 2e-5, 3e-5',
        'batch_sizes': 'Liu et al. 2019, sec. 5.1 and table 10: batch sizes 16 and 32',
        'epochs': 'Liu et al. 2019, sec. 5.1 and table 10: 10 epochs; '
                  f'{_FAIRSEQ} examples/roberta/config/finetuning/*.yaml max_epoch: 10',
        'warmup': 'Liu et al. 2019, sec. 5.1 and table 10: linear warm-up over the first 6% of '
                  f'the steps, then linear decay to 0; {_FAIRSEQ_OLD} examples/roberta/'
                  'README.glue.md: --warmup-updates "6 percent of the number of updates" '
                  '(its QQP row: 28318 of 113272, 25%)',
        'weight_decay': 'Liu et al. 2019, table 10: 0.1; '
                        f'{_FAIRSEQ} examples/roberta/config/finetuning/*.yaml optimizer.'
                        'weight_decay: 0.1 (fairseq\'s Adam decays every parameter, biases '
                        'and LayerNorms included, multiplied by the learning rate)',
        'adam': f'{_FAIRSEQ} examples/roberta/config/finetuning/*.yaml adam_betas: (0.9,0.98), '
                'adam_eps: 1e-06',
        'grad_clip_norm': f'{_FAIRSEQ} examples/roberta/config/finetuning/*.yaml clip_norm: 0.0',
        'max_seq_len': f'{_FAIRSEQ} examples/roberta/config/finetuning/*.yaml max_positions: 512',
        'within_run': 'Liu et al. 2019, sec. 5.1: early stopping on each task\'s dev metric; '
                      f'{_FAIRSEQ} *.yaml best_checkpoint_metric: accuracy',
        'seeds': 'Liu et al. 2019, sec. 5.1: dev results are the median over five random '
                 'initialisations; the seeds themselves are not given: 0-4 here',
        'aggregate': 'Liu et al. 2019, sec. 5.1: the median over five runs',
        'start_from_mnli': 'Liu et al. 2019, sec. 5.1: RTE, STS-B and MRPC fine-tuned from the '
                           'MNLI single-task model (said of its test-set submissions; the '
                           'issue asks it of this protocol, and ModernBERT\'s glue.py does it '
                           'on dev)',
    },
    notes=('fairseq\'s README.glue.md recommends one cell per task from this sweep (MNLI, QNLI, '
           'QQP, SST-2: lr 1e-5, batch 32; RTE: 2e-5, 16; MRPC, CoLA: 1e-5, 16; STS-B: 2e-5, '
           '16); the paper\'s grid is run here, the selection picks the cell.',
           'WNLI: the paper\'s dev table has none; the grid above runs on it too.',
           'Our optimizer leaves biases and LayerNorms undecayed; fairseq\'s decays them.'))

# ModernBERT's GLUE runner: glue.py (the rounds, the MNLI start), src/evals/glue_jobs.py (each
# task's optimizer, epochs and batch), generate_eval_config.py (schedule, seeds).
_MB_JOBS = f'{_MODERNBERT} src/evals/glue_jobs.py'


def _modernbert_grid(lr: float, decoupled_wd: float, epochs: float, batch: int) -> Grid:
  # Composer's DecoupledAdamW shrinks weights by wd x lr(t) / lr(0) per step, not
  # wd x lr(t): the same decay in optax's / torch's convention is wd / lr.
  return _grid(learning_rates=lr, batch_sizes=batch, epochs=epochs, warmup=0.1,
               weight_decay=round(decoupled_wd / lr, 6))


MODERNBERT = Protocol(
    name='modernbert',
    grid=_modernbert_grid(3e-5, 3e-6, 3.0, 32),
    task_grids={
        'mnli': _modernbert_grid(5e-5, 1e-6, 2.0, 64),
        'rte': _modernbert_grid(1e-5, 1e-5, 3.0, 16),
        'qqp': _modernbert_grid(3e-5, 3e-6, 5.0, 16),
        'cola': _modernbert_grid(5e-5, 5e-6, 10.0, 32),
        'mrpc': _modernbert_grid(8e-5, 8e-6, 10.0, 32),
        'qnli': _modernbert_grid(1e-5, 1e-6, 10.0, 16),
        'sst2': _modernbert_grid(3e-5, 3e-6, 3.0, 16),
        'stsb': _modernbert_grid(3e-5, 3e-6, 10.0, 32),
    },
    seeds=(1618, 42, 6033), aggregate='mean', within_run='last',
    start_from_mnli=('rte', 'mrpc', 'stsb'), max_seq_len=256,
    adam_b1=0.9, adam_b2=0.98, adam_eps=1e-6, grad_clip_norm=0.0,
    sources={
        'task_grids': f'{_MB_JOBS}: each Job\'s defaults, DecoupledAdamW(lr, weight_decay), '
                      'max_duration and batch_size (MNLI 5e-5, 1e-6, 2ep, 64; RTE 1e-5, 1e-5, '
                      '3ep, 16; QQP 3e-5, 3e-6, 5ep, 16; CoLA 5e-5, 5e-6, 10ep, 32; MRPC 8e-5, '
                      '8e-6, 10ep, 32; QNLI 1e-5, 1e-6, 10ep, 16; SST-2 3e-5, 3e-6, 3ep, 16; '
                      'STS-B 3e-5, 3e-6, 10ep, 32); MNLI 2ep also in generate_eval_config.py',
        'weight_decay': 'composer DecoupledAdamW: param *= 1 - (lr_t / lr_0) * weight_decay; '
                        'stored here as weight_decay / lr (optax\'s convention); it decays every '
                        'parameter (glue_jobs passes model.parameters())',
        'warmup': f'{_MODERNBERT} generate_eval_config.py scheduler linear_decay_with_warmup, '
                  't_warmup: 0.1dur, alpha_f: 0.0',
        'adam': f'{_MB_JOBS} betas=(0.9, 0.98), eps=1.0e-06',
        'grad_clip_norm': f'{_MODERNBERT} generate_eval_config.py adds no gradient clipping '
                          'algorithm: none',
        'max_seq_len': f'{_MB_JOBS} max_sequence_length=256',
        'seeds': f'{_MODERNBERT} run_evals.py / generate_eval_config.py seeds [1618, 42, 6033, '
                 '3145], seeds[:3] for the GLUE tasks',
        'aggregate': f'{_MODERNBERT} glue.py: results_mean = np.mean over a task\'s runs',
        'within_run': f'{_MODERNBERT} src/evals/finetuning_jobs.py run(): the metrics of '
                      'trainer.state.eval_metrics after fit (the last evaluation)',
        'start_from_mnli': f'{_MODERNBERT} glue.py round_2_task_names = {{"mnli": {{"rte", '
                           '"mrpc", "stsb"}}}}: started from the MNLI job\'s last checkpoint',
        'grid': 'WNLI: ModernBERT\'s GLUE_TASKS leave it out; glue_jobs.py\'s STS-B values run '
                'on it (this default grid)',
    },
    notes=('The paper (Warner et al. 2024, arXiv:2412.13663) reports a sweep per task whose '
           'grid is not in the repository\'s code; it was not read here, so this protocol runs '
           'the repository\'s per-task defaults, one cell per task. AnswerDotAI/ModernBERT '
           'issue 196: the paper\'s GLUE runs used batch 64 for every task.',))

# For a CPU: one cell, two seeds, at most 2,000 training rows per task.
QUICK = Protocol(
    name='quick',
    grid=_grid(learning_rates=0.0, batch_sizes=32, epochs=3.0, warmup=0.1, weight_decay=0.01),
    seeds=(0, 1), aggregate='median', within_run='best', start_from_mnli=(), max_seq_len=128,
    max_train_rows=2000,
    sources={
        'learning_rates': 'mlm_jax finetuning/config.py: 5e-5 at BERT-base\'s width, x 768 / d '
                          'for narrower models (Turc et al. 2019 fine-tune small BERTs at '
                          '1e-4..1e-3), at most 1e-3',
        'batch_sizes': 'BERT\'s 32 (Devlin et al. 2019, sec. 4.1)',
        'epochs': 'BERT\'s 3 (Devlin et al. 2019, sec. 4.1)',
        'warmup': 'BERT\'s 10% (run_classifier.py warmup_proportion)',
        'weight_decay': 'BERT\'s 0.01 (optimization.py)',
        'seeds': 'two, to show the spread: mlm_jax\'s choice for a CPU',
        'max_train_rows': 'mlm_jax\'s choice: a CPU trains 2,000 rows of every task in minutes '
                          'with the tiny models; dev splits are read whole',
        'within_run': 'the best evaluation on dev, as fine-tuning keeps it',
        'max_seq_len': 'BERT\'s 128 (run_classifier.py)',
    },
    notes=('Not a published protocol: figures from it compare models on this machine, not '
           'with papers.',))

PROTOCOLS = {p.name: p for p in (QUICK, BERT, ROBERTA, MODERNBERT)}


def default_name(platform: str) -> str:
  """'quick' off an accelerator; BERT's (4 cells, one seed: the cheapest published) on one."""
  return 'quick' if platform == 'cpu' else 'bert'


def load(name: str) -> Protocol:
  """A shipped protocol by name, or a user's from a JSON file; ConfigError if neither."""
  if name in PROTOCOLS:
    return PROTOCOLS[name]
  if not name.endswith('.json'):
    raise ConfigError(f'--protocol={name!r}: use {", ".join(PROTOCOLS)} or a protocol file '
                      '(.json, with the fields of evaluation/protocols.py).')
  if not os.path.isfile(name):
    raise FileNotFoundError(f'--protocol={name}: no such file.')
  with open(name) as f:
    try:
      values = json.load(f)
    except json.JSONDecodeError as e:
      raise ConfigError(f'--protocol={name}: not valid JSON ({e.msg}, line {e.lineno}).') from e
  return from_dict(values, name)


def from_dict(values: dict[str, Any], where: str = 'protocol') -> Protocol:
  """A Protocol from its to_dict() form (as results.json and protocol files hold it)."""
  fields = {f.name for f in dataclasses.fields(Protocol)}
  unknown = sorted(set(values) - fields)
  if unknown or 'grid' not in values or 'name' not in values or 'seeds' not in values:
    raise ConfigError(f'{where}: unknown fields {unknown} or missing name, grid or seeds; a '
                      f'protocol has {sorted(fields)}.')
  try:
    values = dict(values)
    values['grid'] = _grid(**values['grid'])
    values['task_grids'] = {t: _grid(**g) for t, g in values.get('task_grids', {}).items()}
    for key in ('seeds', 'start_from_mnli', 'notes'):
      if key in values:
        values[key] = tuple(values[key])
    protocol = Protocol(**values)
  except TypeError as e:
    raise ConfigError(f'{where}: {e}') from e
  protocol.check()
  return protocol
