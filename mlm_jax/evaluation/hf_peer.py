"""transformers' run of a cell (`--compare=hf`): AutoModelForSequenceClassification and Trainer.

The same suite, protocol, files and seeds as ours, on the model exported to
Hugging Face's format (a run's `export --workdir`, or the --hf_dir itself).
What must stay true, so that the two columns differ by the fine-tuning alone:

  - each run takes from our run of the same (task, cell, seed) the plan it
    resolved to: the rows' length (texts cut 'longest_first', as ours), the
    number of steps, the warm-up steps, the peak learning rate and the
    evaluation cadence; and the protocol's optimizer (torch's AdamW through
    Trainer: no decay on biases and LayerNorms, as ours), schedule (linear
    warm-up, linear decay to 0), clipping and classifier dropout;
  - the evaluation kept is chosen as ours chooses it (the run's score on the
    first dev split, a tie to the lower loss, then the earlier step), and
    scored with the same metric code (scoring.measures) on every dev split;
  - a task that starts from MNLI starts from transformers' own selected MNLI
    run, loaded with ignore_mismatched_sizes=True (a fresh classifier, the
    pooler kept: what ours does, pretrained.from_finetuned).

What differs and is not controlled: the shuffling of batches (torch's sampler
from the seed), the head's random initialisation, and Trainer's last batch of
an epoch (shorter; ours draws a full batch across the epoch boundary).
Needs the interop extra and accelerate (Trainer's dependency).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from typing import Any

import numpy as np

from mlm_jax.evaluation import protocols as protocols_lib
from mlm_jax.evaluation import scoring
from mlm_jax.evaluation import sweep as sweep_lib
from mlm_jax.finetuning import data as data_lib
from mlm_jax.finetuning import model_dir as model_dir_lib
from mlm_jax.interop import hf as hf_lib


def make_runner(protocol: protocols_lib.Protocol, hf_dir: str, ours_root: str,
                root: str) -> sweep_lib.Runner:
  """transformers' runner: each job fine-tuned from `hf_dir` (or its MNLI start) with the plan
  of our run of the same job under `ours_root`."""
  hf_lib.require('accelerate')   # Trainer needs it: say so before any run.

  def run(job: sweep_lib.Job) -> dict[str, Any]:
    ours_dir = os.path.join(ours_root, os.path.relpath(job.cell_dir, root))
    ours = sweep_lib.read_cell(ours_dir)
    with open(os.path.join(ours_dir, 'model', model_dir_lib.MODEL_FILE)) as f:
      record = json.load(f)
    return finetune_cell(protocol, job, job.start or hf_dir, ours['plan'], record,
                         save=job.suite_task.task.name == 'mnli')

  return sweep_lib.Runner('transformers', root, run)


def _encode(tokenizer: Any, examples: list[data_lib.Example], index: dict[Any, int] | None,
            seq_len: int) -> list[dict[str, Any]]:
  """Each example tokenized as Trainer's collator wants it; label ids (or floats)."""
  columns = list(zip(*[e.texts for e in examples]))
  encoded = tokenizer(*[list(c) for c in columns], truncation='longest_first',
                      max_length=seq_len)
  rows = []
  for i, e in enumerate(examples):
    row = {k: v[i] for k, v in encoded.items()}
    row['labels'] = float(e.label) if index is None else index[e.label]
    rows.append(row)
  return rows


def finetune_cell(protocol: protocols_lib.Protocol, job: sweep_lib.Job, start_dir: str,
                  plan: dict[str, Any], record: dict[str, Any], save: bool) -> dict[str, Any]:
  """Fine-tunes `start_dir` on the job's files with Trainer; returns the cell's record."""
  torch = hf_lib.require('torch')
  transformers = hf_lib.require('transformers')
  st, cell = job.suite_task, job.cell
  task, labels = st.task, record['labels']
  fields = data_lib.Fields(**{k.removesuffix('_field'): v for k, v in st.fields.items()})
  read = lambda split: data_lib.read_examples(st.files[split], task.kind, fields=fields)  # noqa: E731
  index = None if labels is None else {label: i for i, label in enumerate(labels)}
  tokenizer = transformers.AutoTokenizer.from_pretrained(start_dir)
  seq_len = plan['seq_len']
  train = _encode(tokenizer, read('train'), index, seq_len)
  dev = {split: read(split) for split in task.dev_splits}
  dev_rows = {split: _encode(tokenizer, examples, index, seq_len) for split, examples in dev.items()}

  transformers.logging.set_verbosity_error()   # Not the load report of every cell's head.
  transformers.set_seed(job.seed)   # The head's initialisation, as config.seed is ours.
  num_labels = 1 if labels is None else len(labels)
  extra = {'classifier_pooling': 'cls'} if record['model']['variant'] == 'modern' else {}
  model = transformers.AutoModelForSequenceClassification.from_pretrained(
      start_dir, num_labels=num_labels, ignore_mismatched_sizes=True,
      problem_type='regression' if labels is None else 'single_label_classification',
      id2label={i: str(label) for i, label in enumerate(labels or ['score'])},
      label2id={str(label): i for i, label in enumerate(labels or ['score'])},
      classifier_dropout=record['classifier_dropout'], **extra)
  first = task.dev_splits[0]

  def compute(prediction: Any) -> dict[str, float]:
    gold = [e.label for e in dev[first]]
    return scoring.measures(task, np.asarray(prediction.predictions, np.float64), gold, labels,
                            [task.run_score])

  keeper = _BestKeeper(torch, task.run_score)
  last_only = protocol.within_run == 'last'
  args = transformers.TrainingArguments(
      output_dir=os.path.join(job.cell_dir, 'trainer'), seed=job.seed, data_seed=job.seed,
      per_device_train_batch_size=cell.batch_size, per_device_eval_batch_size=64,
      learning_rate=plan['learning_rate'], max_steps=plan['num_steps'],
      warmup_steps=plan['warmup_steps'], lr_scheduler_type='linear',
      weight_decay=cell.weight_decay, adam_beta1=protocol.adam_b1, adam_beta2=protocol.adam_b2,
      adam_epsilon=protocol.adam_eps, max_grad_norm=protocol.grad_clip_norm,
      eval_strategy='no' if last_only else 'steps', eval_steps=None if last_only else
      plan['eval_every'], save_strategy='no', logging_strategy='no', report_to=[],
      disable_tqdm=True, dataloader_num_workers=0)
  trainer = transformers.Trainer(
      model=model, args=args, train_dataset=train, eval_dataset=dev_rows[first],
      data_collator=transformers.DataCollatorWithPadding(tokenizer),
      compute_metrics=compute, callbacks=[keeper])
  trainer.remove_callback(transformers.PrinterCallback)   # Each evaluation's dict, printed.
  trainer.train()
  if keeper.step != plan['num_steps']:
    trainer.evaluate()   # Ours always evaluates at the last step.
  model.load_state_dict(keeper.state)
  metrics = {}
  for split, rows in dev_rows.items():
    logits = np.asarray(trainer.predict(rows).predictions, np.float64)
    wanted = [m for m in task.metrics if m.split == split]
    got = scoring.measures(task, logits, [e.label for e in dev[split]], labels,
                           [m.measure for m in wanted])
    metrics |= {m.name: float(got[m.measure]) for m in wanted}
  if save:   # A task that others start from: its kept model, for them.
    model.save_pretrained(job.model_dir)
    tokenizer.save_pretrained(job.model_dir)
  shutil.rmtree(args.output_dir, ignore_errors=True)
  return {'metrics': metrics, 'best_step': keeper.best_step, 'plan': plan}


class _BestKeeper:
  """A TrainerCallback (duck-typed) that keeps the parameters of the best evaluation so far."""

  def __init__(self, torch: Any, metric: str):
    self._torch, self._metric = torch, metric
    self.best: tuple[float, float] | None = None   # (metric, loss) of the best evaluation.
    self.best_step, self.step, self.state = None, None, None

  def __getattr__(self, name: str) -> Any:
    if name.startswith('on_'):
      return lambda *args, **kwargs: None   # Every other event: nothing to do.
    raise AttributeError(name)

  def on_evaluate(self, args: Any, state: Any, control: Any, metrics: dict[str, float],
                  model: Any = None, **kwargs: Any) -> None:
    value, loss = metrics[f'eval_{self._metric}'], metrics['eval_loss']
    self.step = state.global_step
    # Higher is better for every run score; a tie goes to the lower loss, then the earlier.
    if self.best is None or value > self.best[0] or (value == self.best[0] and
                                                     loss < self.best[1]):
      self.best, self.best_step = (value, loss), state.global_step
      self.state = copy.deepcopy({k: v.detach().cpu() for k, v in model.state_dict().items()})
