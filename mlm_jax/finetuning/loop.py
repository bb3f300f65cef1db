"""The fine-tuning driver: read and check the data -> build -> resume -> loop -> the best model.

`finetune(...)` reads top to bottom like pretraining's loop (training/loop.py)
and reuses its parts: the mesh and host-to-device boundary (runtime/), the
optimizer and schedules (training/step.py), Orbax checkpoints, metrics.jsonl
and TensorBoard, stopping on a signal. Every file is read and checked before
anything is compiled.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
from absl import logging
from jax.experimental import multihost_utils

from mlm_jax import model as model_lib
from mlm_jax.errors import require
from mlm_jax.finetuning import batches as batches_lib
from mlm_jax.finetuning import config as config_lib
from mlm_jax.finetuning import data as data_lib
from mlm_jax.finetuning import task_eval
from mlm_jax.finetuning import model_dir
from mlm_jax.finetuning import pretrained as pretrained_lib
from mlm_jax.finetuning import report as report_lib
from mlm_jax.finetuning import scores
from mlm_jax.finetuning import step as step_lib
from mlm_jax.runtime import sharding
from mlm_jax.training import checkpoint
from mlm_jax.training import feed as feed_lib
from mlm_jax.training import lock
from mlm_jax.training import metrics
from mlm_jax.training import preemption


@dataclasses.dataclass(frozen=True)
class TaskData:
  """A task's checked and encoded files, and the labels of its training file."""

  train: data_lib.Encoded
  eval: data_lib.Encoded
  labels: list | None
  seq_len: int


def finetune(workdir: str | None, out_dir: str, task: str, train_path: str, eval_path: str,
             config: ml_collections.ConfigDict, *, hf_dir: str | None = None,
             pretrained: pretrained_lib.Pretrained | None = None) -> dict[str, Any]:
  """Fine-tunes the pretraining run in `workdir`, or the Hugging Face masked LM in `hf_dir`
  (exactly one), or an encoder already loaded (`pretrained`, with neither), on `train_path`
  into `out_dir` (resuming there).

  Evaluates on `eval_path` every plan.eval_every steps and at the end, and
  keeps the parameters of the best evaluation by config.train.best_metric
  in OUT/best (what predict and export load). Returns the step reached, the
  step the run was planned to end at (num_steps), whether a signal stopped it
  short (stopped), the best evaluation's step (best_step), metric
  (best_metric) and scores (eval_*); no scores when stopped before any
  evaluation. One run at a time per `out_dir`: another is refused
  (lock.WorkdirLockedError).
  """
  out_dir = os.path.abspath(out_dir)
  with lock.hold(out_dir):
    return _finetune(workdir, out_dir, task, train_path, eval_path, config, hf_dir=hf_dir,
                     pretrained=pretrained)


@dataclasses.dataclass(frozen=True)
class _Setup:
  """What a run is, once its encoder and files are read: nothing built, nothing written."""

  pretrained: pretrained_lib.Pretrained
  model_cfg: model_lib.ModelConfig
  data: TaskData
  selection: config_lib.Selection
  classifier_dropout: float
  record: dict[str, Any]     # model.json's contents.
  plan: config_lib.Plan
  train: ml_collections.ConfigDict   # config.train with the plan's values.


@dataclasses.dataclass
class _Started:
  """A run built and resumed: its mesh, steps, savers, state and the best evaluation so far."""

  mesh: Any
  built: step_lib.Built
  checkpointer: checkpoint.Checkpointer
  best_checkpointer: checkpoint.Checkpointer
  meta: dict[str, Any]
  state: Any
  start_step: int
  best: dict[str, Any] | None
  resolved: dict[str, Any]


def _finetune(workdir: str | None, out_dir: str, task: str, train_path: str, eval_path: str,
              config: ml_collections.ConfigDict, *, hf_dir: str | None,
              pretrained: pretrained_lib.Pretrained | None) -> dict[str, Any]:
  start_time, is_main = time.perf_counter(), jax.process_index() == 0
  config_lib.check_config(config, jax.device_count())
  if pretrained is None:
    pretrained = pretrained_lib.load(workdir, hf_dir)
  setup = _set_up(pretrained, out_dir, task, train_path, eval_path, config)
  run = _start(setup, out_dir, task, config, is_main)
  step, stop_signal, best = _train(setup, run, out_dir, task, config, is_main)
  if stop_signal:
    logging.warning('Stopped by %s at step %d; checkpoint saved. Run the same command to '
                    'resume.', stop_signal, step)
  elif is_main:
    already = f'(already at step {step}) ' if step == run.start_step else ''
    print(f'{already}best: {scores.describe(best["step"], best["eval"])}; kept in '
          f'{model_dir.best_dir(out_dir)} (what predict and export use)', flush=True)
  out = {'step': step, 'num_steps': setup.plan.num_steps, 'stopped': bool(stop_signal),
         'wall_time_s': time.perf_counter() - start_time}
  if best is not None:
    out |= {'best_step': best['step'], 'best_metric': best['metric'],
            **{f'eval_{k}': v for k, v in best['eval'].items()}}
  return out


def _set_up(pretrained: pretrained_lib.Pretrained, out_dir: str, task: str, train_path: str,
            eval_path: str, config: ml_collections.ConfigDict) -> _Setup:
  """The encoder's config, both files read and checked, the record and plan (nothing built);
  refuses an `out_dir` holding checkpoints of another task, label set or row length."""
  model_cfg, model_section = _model_config(pretrained, config)
  row_format = model_dir.row_format(pretrained.tokenizer, model_cfg)
  data = read_task_data(task, train_path, eval_path, pretrained, config.data, row_format)
  selection = config_lib.selection(task, config.train.best_metric,
                                   len(data.labels) if data.labels else None)
  classifier_dropout = _value_or(config.model.classifier_dropout, model_cfg.dropout_rate)
  record = model_dir.model_record(task, data.labels, data.seq_len, model_cfg, model_section,
                                  classifier_dropout, pretrained.source, pretrained.tokenizer)
  model_dir.check_resumable(out_dir, record)
  plan = config_lib.plan(config.train, len(data.train), model_cfg.hidden_size)
  return _Setup(pretrained, model_cfg, data, selection, classifier_dropout, record, plan,
                plan.train_section(config.train))


def _start(setup: _Setup, out_dir: str, task: str, config: ml_collections.ConfigDict,
           is_main: bool) -> _Started:
  """Builds the steps on the mesh, resumes (or starts from the encoder), writes OUT's files."""
  plan, train = setup.plan, setup.train
  mesh = sharding.make_mesh(config.mesh.fsdp)
  built = step_lib.build(setup.model_cfg, task, setup.record['num_outputs'],
                         setup.classifier_dropout, train, setup.data.seq_len, config.seed, mesh)
  checkpointer = checkpoint.Checkpointer(model_dir.checkpoint_dir(out_dir), train)
  meta = model_dir.checkpoint_meta(setup.model_cfg, setup.record)
  state, start_step = _resume(built, checkpointer, meta, setup.pretrained)
  best = _best_so_far(model_dir.best_dir(out_dir), start_step, is_main)
  # Only the best parameters: the optimizer state is for resuming, which checkpoints/ does.
  best_checkpointer = checkpoint.Checkpointer(
      model_dir.best_dir(out_dir),
      ml_collections.ConfigDict({'checkpoint_every': plan.num_steps + 1, 'keep_checkpoints': 1}))
  resolved = _resolved_config(config, plan, setup.data, setup.selection)
  if is_main:
    model_dir.write(out_dir, setup.record, resolved, setup.pretrained.tokenizer)
  logging.info('Fine-tuning %s (%s, %d labels) from %s: %d steps of %d rows (%d per epoch), '
               'peak learning rate %.3g, evaluating every %d steps, keeping the best %s',
               task, setup.model_cfg.variant, setup.record['num_outputs'],
               setup.pretrained.description, plan.num_steps, train.batch_size,
               plan.steps_per_epoch, plan.learning_rate, plan.eval_every,
               setup.selection.metric)
  return _Started(mesh, built, checkpointer, best_checkpointer, meta, state, start_step, best,
                  resolved)


def _train(setup: _Setup, run: _Started, out_dir: str, task: str,
           config: ml_collections.ConfigDict, is_main: bool
           ) -> tuple[int, str | None, dict[str, Any] | None]:
  """The loop: steps, logs, evaluations (the best kept), checkpoints, until the plan's last
  step or a signal. Returns (the step reached, the signal's name if one stopped it, the best
  evaluation)."""
  plan, train, data, mesh = setup.plan, setup.train, setup.data, run.mesh
  state, start_step, best = run.state, run.start_step, run.best
  host_batches = batches_lib.TrainBatches(
      data.train.arrays(), train.batch_size, config.seed, start_step=start_step,
      process_index=jax.process_index(), process_count=jax.process_count())
  feed = feed_lib.DeviceFeed(host_batches, mesh)
  log = report_lib.FinetuneLog(
      metrics.MetricsWriter(out_dir, enabled=is_main, tensorboard=train.tensorboard,
                            hparams=run.resolved, start_step=start_step),
      start_step=start_step, num_steps=plan.num_steps, show=is_main,
      checkpoint_dir=run.checkpointer.directory)
  evaluate = functools.partial(_evaluate, run.built.eval_step, task=task, data=data,
                               batch_size=config.eval.batch_size, mesh=mesh)

  # A best evaluation's parameters are written with the next checkpoint (at every evaluation,
  # by default), so that every best up to a checkpoint is on disk when a run resumes from it;
  # until then they wait as a copy (the train step donates the state's buffers).
  unsaved = None

  def keep_if_best(step: int, result: dict[str, Any], saving: bool) -> None:
    nonlocal best, unsaved
    if setup.selection.better(result, best['eval'] if best else None):
      best = {'step': step, 'metric': setup.selection.metric,
              'value': result[setup.selection.metric], 'eval': result}
      kept = state.replace(opt_state={})
      unsaved = (step, kept if saving else jax.tree_util.tree_map(jnp.copy, kept), best)

  def save_best() -> None:
    nonlocal unsaved
    if unsaved is not None:
      step, kept, record = unsaved
      run.best_checkpointer.save(step, kept, {**run.meta, 'best': record}, force=True)
      unsaved = None

  stop = preemption.StopRequest(multi_process=jax.process_count() > 1)
  step, stopping = start_step, False
  try:
    with stop:
      while step < plan.num_steps and not stopping:
        state, step_metrics = run.built.train_step(state, feed.pop(), run.built.dropout_rng)
        feed.fill()  # The next batch goes to the devices while this step runs.
        step += 1
        stop.poll(step)
        stopping = stop.requested
        log.add(step_metrics)
        if step == start_step + 1:
          log.restart()   # The first step compiles: keep it out of the speed.
        final = step == plan.num_steps or stopping
        if final or step % train.log_every == 0:
          log.write(step)
        saving = final or run.checkpointer.should_save(step)
        if step == plan.num_steps or step % plan.eval_every == 0:
          result = evaluate(state)
          log.write_eval(step, result)
          keep_if_best(step, result, saving)
        if saving:
          save_best()
          run.checkpointer.save(step, state, run.meta, force=final)
      if best is None and not stopping:
        # Finished before the best was kept (a directory from before OUT/best): keep the last.
        keep_if_best(step, evaluate(state), True)
        save_best()
  finally:
    log.close()
    for saver in (run.checkpointer, run.best_checkpointer):
      saver.wait()
      saver.close()
  return step, (stop.signal_name or 'a signal') if stopping else None, best


# ---------------------------------------------------------------- helpers


def read_task_data(task: str, train_path: str, eval_path: str,
                   pretrained: pretrained_lib.Pretrained, data: ml_collections.ConfigDict,
                   row_format: data_lib.RowFormat) -> TaskData:
  """Both files (tfds splits) read, checked and encoded; truncation logged.

  DataError for the first bad row; `data`: the config's data section (the
  sequence length, the fields to read, the tfds data dir). The sequence
  length: data.seq_len, else the pretraining run's, else (a model of unknown
  row length) the longest row of the two files rounded up to a multiple of
  8, at most data.max_seq_len (512) and the position table.
  """
  limit = pretrained.model_cfg.max_position_embeddings
  seq_len = data.seq_len or pretrained.seq_len
  require(seq_len is None or seq_len <= limit,
          f'config.data.seq_len={seq_len} exceeds the position table of the pretrained model '
          f'({limit} positions).')
  fields = data_lib.Fields.from_config(data)
  read = functools.partial(data_lib.read_examples, task=task, fields=fields,
                           tfds_data_dir=data.tfds_data_dir)
  train_examples = read(train_path)
  labels = data_lib.infer_labels(train_examples, task)
  eval_examples = read(eval_path)
  data_lib.check_labels(eval_examples, labels, task, eval_path, fields)
  if labels is not None and len(labels) < 2:
    raise data_lib.DataError(f'{train_path}: every row has the label {labels[0]!r}; a '
                             'classifier needs at least two.')
  longest = seq_len or min(limit, data.max_seq_len)
  encoded = {}
  for name, path, examples in (('train', train_path, train_examples),
                               ('eval', eval_path, eval_examples)):
    encoded[name] = data_lib.encode(examples, task, pretrained.tokenizer, longest, labels, path,
                                    fields, row_format)
  if seq_len is None:
    filled = max(e.longest() for e in encoded.values())
    multiple = config_lib.SEQ_LEN_MULTIPLE
    seq_len = min(longest, -(-filled // multiple) * multiple)
    encoded = {name: e.trimmed(seq_len) for name, e in encoded.items()}
    logging.info('Rows of %d pieces: the longest row of the files (%d), rounded up to a multiple '
                 'of %d, at most %d (set --config.data.seq_len to choose).', seq_len, filled,
                 multiple, longest)
  for name, path in (('train', train_path), ('eval', eval_path)):
    message = data_lib.describe_truncation(encoded[name], path, seq_len)
    if message:
      logging.warning('%s', message)
  return TaskData(encoded['train'], encoded['eval'], labels, seq_len)


def _best_so_far(directory: str, start_step: int, is_main: bool) -> dict[str, Any] | None:
  """The best evaluation kept in `directory` ({'step', 'metric', 'value', 'eval'}), or None.

  One kept from beyond the checkpoint resumed (its train checkpoint was lost)
  is dropped: the run computes it again, and a best saved at an earlier step
  than one on disk would be rotated away first.
  """
  steps = model_dir.saved_steps(directory)
  if not steps:
    return None
  if steps[-1] > start_step:
    logging.warning('%s holds the best evaluation of step %d, past the step %d resumed from: '
                    'evaluating again from there.', directory, steps[-1], start_step)
    if is_main:
      shutil.rmtree(directory)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices('mlm_jax:finetune_best_dropped')
    return None
  _, _, meta = checkpoint.restore_params(directory, steps[-1])
  return meta.get('best')


def _resume(built: step_lib.Built, checkpointer: checkpoint.Checkpointer, meta: dict[str, Any],
            pretrained: pretrained_lib.Pretrained) -> tuple[Any, int]:
  """(state, step): the latest checkpoint in the output directory, else the pretrained encoder."""
  # The newest checkpoint that reads (any newer that does not is set aside), else a fresh state.
  state, start_step = checkpointer.restore_or_init(built.abstract_state, built.init_state, meta)
  if start_step:
    logging.info('Resumed from %s at step %d', checkpointer.directory, start_step)
  else:
    state = step_lib.with_pretrained(state, pretrained.params, pretrained.description)
  return state, start_step


def _resolved_config(config: ml_collections.ConfigDict, plan: config_lib.Plan,
                     data: TaskData, selection: config_lib.Selection) -> dict[str, Any]:
  """The config as a dict, with what it resolved to for these files on this machine."""
  return config.to_dict() | {'resolved': dataclasses.asdict(plan) | {
      'seq_len': data.seq_len, 'train_rows': len(data.train), 'eval_rows': len(data.eval),
      'train_truncated': data.train.truncated, 'eval_truncated': data.eval.truncated,
      'best_metric': selection.metric, 'num_devices': jax.device_count(),
      'backend': jax.default_backend()}}


def _evaluate(eval_step: Any, state: Any, *, task: str, data: TaskData, batch_size: int,
              mesh) -> dict[str, Any]:
  """Loss and scores of the eval file (see task_eval.score)."""
  logits = task_eval.all_logits(lambda batch: eval_step(state, batch), data.eval, batch_size,
                                   mesh)
  return task_eval.score(task, logits, data.eval, data.labels)


def _value_or(value: float | None, default: float) -> float:
  return default if value is None else value


def _model_config(pretrained: pretrained_lib.Pretrained, config: ml_collections.ConfigDict
                  ) -> tuple[model_lib.ModelConfig, dict[str, Any]]:
  """The encoder's ModelConfig for fine-tuning here, and the config.model section it records."""
  section = dict(pretrained.model_section)
  section['dropout_rate'] = _value_or(config.model.dropout_rate, section['dropout_rate'])
  platform = jax.devices()[0].platform
  dtype = model_lib.compute_dtype(section['dtype'], platform)
  cfg = model_dir.model_config({'model': section, 'vocab_size': pretrained.model_cfg.vocab_size,
                                'padded_vocab_size': pretrained.model_cfg.padded_vocab_size},
                               dtype, platform=platform, sentence_pair_head=False)
  model_lib.check_attention_platform(cfg)
  return cfg, section
