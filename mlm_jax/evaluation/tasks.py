"""The tasks of a suite: what each is (its kind, labels, metrics, dev splits), GLUE's nine as data.

A task names the fine-tuning kind its head is (finetuning/data.py's classify,
pair, regress, tag), its label set where it has one, its dev splits and the
metrics reported on each. What must stay true:

  - the label sets are GLUE's own spellings (the tsv files' values); the
    tfds and Hugging Face `datasets` copies name their classes, and
    TFDS_HF_NAMES maps those names onto these, so the three layouts give the
    same rows and labels;
  - F1 is the binary F1 of the `positive` label (MRPC: '1', equivalent; QQP:
    '1', duplicate), as GLUE's scorer computes it;
  - a task's score is the mean of its metrics (the GLUE leaderboard's rule),
    and the GLUE average is the mean of the task scores without WNLI, which
    BERT, RoBERTa and ModernBERT leave out of their dev averages.
"""

from __future__ import annotations

import dataclasses

from mlm_jax.errors import ConfigError
from mlm_jax.finetuning import data as data_lib

# What a metric is computed as (scoring.measures): label accuracy, Matthews' correlation,
# the binary F1 of the positive label, the macro F1 over labels, Pearson's r, Spearman's rho;
# tag tasks: word accuracy and entity F1 (finetuning/scores.tagging).
MEASURES = {'classify': ('accuracy', 'mcc', 'f1', 'macro_f1'),
            'pair': ('accuracy', 'mcc', 'f1', 'macro_f1'),
            'regress': ('pearson', 'spearman'), 'tag': ('accuracy', 'f1')}
# The score a fine-tuning run keeps its best evaluation by (finetuning/config.TASK_SCORES).
RUN_SCORES = {'classify': ('accuracy', 'mcc'), 'pair': ('accuracy', 'mcc'),
              'regress': ('pearson', 'spearman'), 'tag': ('f1', 'accuracy')}


@dataclasses.dataclass(frozen=True)
class Metric:
  """One reported figure: `name` in the tables, `measure` computed on dev split `split`."""

  name: str
  split: str
  measure: str


@dataclasses.dataclass(frozen=True)
class Task:
  """A task of a suite. labels None: regress (or a user task whose labels its files decide)."""

  name: str
  kind: str
  metrics: tuple[Metric, ...]
  labels: tuple[str, ...] | None = None
  positive: str | None = None      # F1's positive label.
  # The score the fine-tuning run keeps its best evaluation by, on the first dev split.
  run_score: str = 'accuracy'
  title: str = ''                  # As the tables print it: 'CoLA'.

  @property
  def dev_splits(self) -> tuple[str, ...]:
    """The dev splits, in order; the first is the one the fine-tuning run evaluates on."""
    return tuple(dict.fromkeys(m.split for m in self.metrics))

  def check(self) -> None:
    """ConfigError naming what a task (of a user's suite file) gets wrong."""
    if self.kind not in data_lib.TASKS:
      raise ConfigError(f'task {self.name!r}: kind {self.kind!r} is none of {data_lib.TASKS}.')
    for m in self.metrics:
      if m.measure not in MEASURES[self.kind]:
        raise ConfigError(f'task {self.name!r}: metric {m.measure!r} is not reported for kind '
                         f'{self.kind!r} (use {", ".join(MEASURES[self.kind])}).')
      if m.measure == 'f1' and self.kind != 'tag' and self.positive is None:
        raise ConfigError(f'task {self.name!r}: metric f1 needs the positive label ("positive").')
    if self.run_score not in RUN_SCORES[self.kind]:
      raise ConfigError(f'task {self.name!r}: a run of kind {self.kind!r} keeps its best '
                       f'evaluation by {" or ".join(RUN_SCORES[self.kind])}, not '
                       f'{self.run_score!r}.')


def _dev(*measures: str) -> tuple[Metric, ...]:
  return tuple(Metric(m, 'dev', m) for m in measures)


_BINARY = ('0', '1')
_ENTAILMENT = ('entailment', 'not_entailment')
GLUE: dict[str, Task] = {t.name: t for t in (
    Task('cola', 'classify', _dev('mcc'), _BINARY, run_score='mcc', title='CoLA'),
    Task('sst2', 'classify', _dev('accuracy'), _BINARY, title='SST-2'),
    Task('mrpc', 'pair', _dev('f1', 'accuracy'), _BINARY, positive='1', title='MRPC'),
    Task('stsb', 'regress', _dev('pearson', 'spearman'), run_score='pearson', title='STS-B'),
    Task('qqp', 'pair', _dev('f1', 'accuracy'), _BINARY, positive='1', title='QQP'),
    Task('mnli', 'pair', (Metric('accuracy_m', 'dev_matched', 'accuracy'),
                          Metric('accuracy_mm', 'dev_mismatched', 'accuracy')),
         ('contradiction', 'entailment', 'neutral'), title='MNLI'),
    Task('qnli', 'pair', _dev('accuracy'), _ENTAILMENT, title='QNLI'),
    Task('rte', 'pair', _dev('accuracy'), _ENTAILMENT, title='RTE'),
    Task('wnli', 'pair', _dev('accuracy'), _BINARY, title='WNLI'),
)}
# Left out of the GLUE average (see the module docstring).
NOT_AVERAGED = ('wnli',)
# STS-B's similarity scores lie in [0, 5].
STSB_RANGE = (0.0, 5.0)

# tfds's `glue/*` and Hugging Face's `nyu-mll/glue` name each class (ClassLabel names, in
# the order of their integers); GLUE's files spell the same classes as below.
TFDS_HF_NAMES: dict[str, dict[str, str]] = {
    'cola': {'unacceptable': '0', 'acceptable': '1'},
    'sst2': {'negative': '0', 'positive': '1'},
    'mrpc': {'not_equivalent': '0', 'equivalent': '1'},
    'qqp': {'not_duplicate': '0', 'duplicate': '1'},
    'mnli': {n: n for n in ('entailment', 'neutral', 'contradiction')},
    'qnli': {n: n for n in _ENTAILMENT},
    'rte': {n: n for n in _ENTAILMENT},
    'wnli': {'not_entailment': '0', 'entailment': '1'},
}
# tfds's and Hugging Face's name of each dev split.
TFDS_HF_SPLITS = {'train': 'train', 'dev': 'validation', 'dev_matched': 'validation_matched',
                  'dev_mismatched': 'validation_mismatched'}


def score(task: Task, figures: dict[str, float]) -> float:
  """The task's score: the mean of its metrics (GLUE's rule for a task with several)."""
  return sum(figures[m.name] for m in task.metrics) / len(task.metrics)


def glue_tasks(names: list[str] | None) -> list[Task]:
  """GLUE's tasks named (all nine for None), in GLUE's order; ConfigError for an unknown one."""
  if not names:
    return list(GLUE.values())
  unknown = [n for n in names if n not in GLUE]
  if unknown:
    raise ConfigError(f'--tasks: {", ".join(unknown)} is not a GLUE task; GLUE has '
                     f'{", ".join(GLUE)}.')
  return [t for t in GLUE.values() if t.name in names]
