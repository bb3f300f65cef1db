"""The driver: build -> resume -> loop (step, log, evaluate, save) -> summary.

`train_and_evaluate(run, workdir)` reads top to bottom like the data flow
of docs/design.md; each arrow is one call into the module that owns it. The
run comes planned (config/run_plan.py's resolve, which the command calls):
this package never resolves, checks or patches a config itself; each phase
trains with the config its plan gives.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import time
from typing import Any

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
from absl import logging
from jax.experimental import multihost_utils

from mlm_jax.config import fields
from mlm_jax.config import phases
from mlm_jax.config import run_plan
from mlm_jax.data import masking
from mlm_jax.data import pipeline
from mlm_jax.data import prepare
from mlm_jax.data import prepared
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.runtime import host_malloc
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
from mlm_jax.training import checkpoint
from mlm_jax.training import composer_init
from mlm_jax.training import feed as feed_lib
from mlm_jax.training import heldout
from mlm_jax.training import init_from
from mlm_jax.training import lock
from mlm_jax.training import metrics
from mlm_jax.training import mixture_run
from mlm_jax.training import optimizer
from mlm_jax.training import preemption
from mlm_jax.training import profiling
from mlm_jax.training import report as report_lib
from mlm_jax.training import state as state_lib
from mlm_jax.training import summary
from mlm_jax.training import workdir as workdir_lib


def train_and_evaluate(run: run_plan.RunPlan, workdir: str) -> dict[str, Any]:
  """Trains until config.train.num_steps, or through every phase of config.phases (resuming
  from `workdir`); returns the run's summary.

  `run`: planned by run_plan.resolve (with config.init, the checkpoint's
  architecture filled in; for a run in phases, given the same `workdir`). One
  run at a time per workdir: another is refused (lock.WorkdirLockedError).
  """
  workdir, plan = os.path.abspath(workdir), run.plan
  with lock.hold(workdir):
    if not plan.phased:
      return _train_phase(workdir, plan, plan.phases[0]).summary
    if jax.process_index() == 0:
      workdir_lib.record_plan(workdir, plan.describe())
    while True:
      phase = plan.phase_at(_first_step(run.config, workdir))
      done = _train_phase(workdir, plan, phase)
      if done.stopped or (done.finished and phase is plan.phases[-1]):
        return done.summary


@dataclasses.dataclass(frozen=True)
class _PhaseEnd:
  summary: dict[str, Any]
  stopped: bool    # By a signal: the same command resumes.
  finished: bool   # The phase ran to its last step (else the checkpoint read was older).


def _train_phase(workdir: str, plan: phases.Plan, phase: phases.Phase) -> _PhaseEnd:
  config = phase.config
  run_start, is_main = time.perf_counter(), jax.process_index() == 0
  # ----------------------------------------------------------------- build
  data, masker, mesh, built = _build(config, plan, phase)
  workdir_lib.check_tokenizer(workdir, data.tokenizer)
  # ---------------------------------------------------------------- resume
  # Each phase's last checkpoint is kept: a branch (config.init.branch) may start there.
  checkpointer = checkpoint.Checkpointer(
      workdir_lib.checkpoint_dir(workdir), config.train,
      keep_steps=[p.end_step for p in plan.phases] if plan.phased else ())
  state, start_step, restored = _resume(built, checkpointer, config, data, plan, phase)
  branched = bool(config.init.branch) and not restored
  if branched and is_main:  # Its history up to the branch: metrics and a mixture's hand-overs.
    trunk = os.path.expanduser(config.init.workdir)
    metrics.start_from(trunk, workdir, start_step)
    workdir_lib.start_handovers_from(trunk, workdir, phase.index)
  if start_step < phase.start_step:  # The phase's checkpoint did not read: an earlier phase's.
    checkpointer.close()
    return _PhaseEnd({}, stopped=False, finished=False)
  if phase.fresh_optimizer and start_step == phase.start_step:
    state = state.replace(opt_state=built.fresh_opt_state(state.params))
    logging.info('Phase %r starts a fresh optimizer at step %d', phase.name, start_step)
  if plan.phased:
    logging.info('Phase %d/%d %r: steps %d..%d, %s', phase.index + 1, len(plan.phases),
                 phase.name, phase.start_step, phase.end_step, plan.describe()[phase.index])
  resolved = workdir_lib.resolved_config(config, data)
  if is_main:   # Only once the checkpoints are known to fit: a refused resume keeps the record.
    workdir_lib.record(workdir, resolved, data.tokenizer)
  _log_start(data, built, state, mesh)
  # ------------------------------------------------------------------ loop
  train, series = config.train, metrics.read_metrics(workdir)
  # None: one corpus. A run that starts in a later phase from a Composer checkpoint's step has
  # no hand-over from the phase before; a branch has its trunk's.
  mixed = _mixture(workdir, data, plan, phase, start_step, series,
                   handed_over=restored or branched)
  # The stream rows of each step's batch (a growing batch pads the micro-batches it leaves).
  positions = functools.partial(plan.positions, capacity=train.batch_size,
                                micro_batches=train.grad_accum_steps)
  batches = pipeline.train_batches(
      data.source('train'), masker, global_batch=train.batch_size, seed=config.seed,
      start_step=start_step, process_index=jax.process_index(),
      process_count=jax.process_count(), prefetch=config.input.prefetch,
      worker_count=config.input.worker_count, sentence_pair=config.sentence_pair.task,
      order=mixed and mixed.order, positions=positions)
  feed = feed_lib.DeviceFeed(batches, mesh)
  log = report_lib.TrainingLog(
      metrics.MetricsWriter(workdir, enabled=is_main, tensorboard=train.tensorboard,
                            hparams=resolved, start_step=start_step),
      feed, start_step=start_step, num_steps=train.num_steps, show=is_main,
      earlier_tokens=summary.tokens_before(series, start_step),
      checkpoint_dir=checkpointer.directory,
      figures=functools.partial(_step_figures, plan, phase, mixed))
  profiler = profiling.StepProfiler(workdir, config.profile, resumed_at=start_step)
  stop = preemption.StopRequest(multi_process=jax.process_count() > 1)
  step, last_eval, stopping = start_step, {}, False
  eval_masker = dataclasses.replace(masker, rate_schedule=None)
  with stop, _closing(batches, profiler, log, checkpointer):
    while step < train.num_steps and not stopping:
      with profiler.step_context(step + 1):
        state, step_metrics = built.train_step(state, feed.pop(), built.dropout_rng)
      feed.fill()  # The next batch goes to the devices while this step runs.
      step += 1
      stop.poll(step)
      stopping = stop.requested  # Read once: a signal may land at any moment.
      log.add(step_metrics)
      if profiler.after_step(step, (state, step_metrics)):
        log.restart()  # Tracing slowed these steps: keep them out of tokens/s.
      if step == start_step + 1:
        logging.info('First step (compile included) took %.1fs', log.first_step_done())
      final = step == train.num_steps or stopping
      if final or step % train.log_every == 0:  # A stop logs too: a resume knows the tokens.
        log.write(step)
      if step == train.num_steps or step % train.eval_every == 0:
        # Held-out masks at the phase's select_rate: comparable from one evaluation to the next.
        last_eval = heldout.evaluate_with_ema(built.eval_step, state, data, eval_masker,
                                              config.eval, config.sentence_pair.task, mesh)
        log.write_eval(step, last_eval)
      if step == phase.end_step and mixed is not None and is_main:
        _hand_over(workdir, plan, phase, mixed)  # Before the boundary's checkpoint.
      if final or checkpointer.should_save(step):
        # Never save a diverged state: a NaN loss means NaN parameters.
        report_lib.check_finite(float(step_metrics['loss']), step, checkpointer.directory)
        checkpointer.save(step, state, fields.shape_record(built.model_cfg), force=final)
  if stopping:
    logging.warning('Stopped by %s at step %d; checkpoint saved. Run the same command to '
                    'resume.', stop.signal_name, step)
  # --------------------------------------------------------------- summary
  result = _finish(config, built, state, mesh, workdir, log, last_eval, step=step,
                   start_step=start_step, wall_time_s=time.perf_counter() - run_start)
  return _PhaseEnd(result, stopped=stopping, finished=step >= train.num_steps)


def _mixture(workdir: str, data: prepared.PreparedData, plan: phases.Plan, phase: phases.Phase,
             start_step: int, series: dict[str, dict[int, float]],
             handed_over: bool = True) -> mixture_run.MixtureRun | None:
  """The phase's mixture (None: one corpus). A phase that reads the same rows as the one before
  it continues its streams from the hand-over recorded at their boundary, so that no source's
  stream starts over at a change of shares."""
  if data.num_parts == 1:
    return None
  keywords: dict[str, Any] = {'start_position': int(plan.rows_before(phase.start_step))}
  if (handed_over and phase.index
      and fields.same_rows(plan.phases[phase.index - 1].config, phase.config)):
    keywords = _recorded_handover(workdir, phase, data.num_parts)
  return mixture_run.MixtureRun(phase.config, data, start_step, series,
                                position_of=lambda step: int(plan.rows_before(step)), **keywords)


def _recorded_handover(workdir: str, phase: phases.Phase, parts: int) -> dict[str, Any]:
  """The hand-over recorded at the start of `phase`, as process 0 read it (every process draws
  the same rows, wherever its copy of the workdir is)."""
  recorded = workdir_lib.read_handovers(workdir).get(str(phase.index))
  if jax.process_count() > 1:  # [found, start_position, rows_before[K], tokens_before[K]]
    flat = np.zeros(2 + 2 * parts, np.int64)
    if recorded is not None and jax.process_index() == 0:
      flat[:] = [1, recorded['start_position'], *recorded['rows_before'],
                 *recorded['tokens_before']]
    flat = np.asarray(multihost_utils.broadcast_one_to_all(flat))
    recorded = None if not flat[0] else {'start_position': int(flat[1]),
                                         'rows_before': flat[2:2 + parts].tolist(),
                                         'tokens_before': flat[2 + parts:].tolist()}
  if recorded is None:
    raise checkpoint.CheckpointReadError(
        f'{workdir} holds no record of where the mixture stood at the start of phase '
        f'{phase.name!r} ({workdir_lib.HANDOVER_FILE}): the phase before writes it at its last '
        'step. Continue from a checkpoint of that phase, or start the run again.')
  return recorded


def _hand_over(workdir: str, plan: phases.Plan, phase: phases.Phase,
               mixed: mixture_run.MixtureRun) -> None:
  """Records where the mixture's streams stand at the phase's end, for the next phase that
  reads the same rows."""
  following = phase.index + 1
  if following < len(plan.phases) and fields.same_rows(phase.config,
                                                       plan.phases[following].config):
    workdir_lib.record_handover(workdir, following,
                                mixed.handover(int(plan.rows_before(phase.end_step))))


def _step_figures(plan: phases.Plan, phase: phases.Phase, mixed: mixture_run.MixtureRun | None,
                  step: int) -> dict[str, Any]:
  """What a log record adds at `step` (steps done): the phase, and the global batch, the
  masking rate and the nominal tokens (rows x T) of the plan; a mixture's figures per source."""
  last = step - 1  # The step just taken.
  out = {'batch_size': int(plan.batch_size(last)),
         'masking_rate': float(plan.masking_rate(last)[0]),
         'planned_tokens': int(plan.tokens_before(step))}
  if plan.phased:
    out |= {'phase': phase.name, 'phase_index': phase.index}
  if mixed is not None:
    out |= mixed.figures(step)
  return out


def evaluate_start(config: ml_collections.ConfigDict) -> dict[str, Any]:
  """The held-out figures of the weights a run would start from, without training.

  `config`: resolved by run_plan.resolve. config.init's model (a published
  checkpoint on a new domain's text: the "before" of continued pretraining;
  a Composer checkpoint's weights), else a fresh initialisation; the
  config's data (prepared if needed), masks and eval settings, as `train`
  evaluates. Prints the eval line on process 0.
  """
  data, masker, mesh, built = _build(config)
  state = built.init_state()
  if config.init.composer:
    state = composer_init.initial_state(state, composer_init.read(config.init.composer),
                                        built.model_cfg)
  elif config.init.hf_dir or config.init.workdir:
    state = init_from.initial_state(state, config, built.model_cfg, data.added_tokens())
  result = heldout.evaluate(built.eval_step, state, data, masker, config.eval,
                                 config.sentence_pair.task, mesh)
  if jax.process_index() == 0:
    print(summary.eval_line(0, result), flush=True)
  return result


# ---------------------------------------------------------------- helpers


def _build(config: ml_collections.ConfigDict, plan: phases.Plan | None = None,
           phase: phases.Phase | None = None) -> tuple[
    prepared.PreparedData, masking.Masker, Any, build_lib.Built]:
  """(data, masker, mesh, built step functions) of a run of the resolved `config` (the config
  of `phase` of `plan`, when given)."""
  data = _prepared_data(config)
  vocab_size = tok_lib.model_vocab_size(config.model.vocab_size, data.tokenizer.vocab_size)
  rate_schedule = plan.rate_schedule(phase) if phase is not None else None
  masker = masking.make_masker(config.masking, data.tokenizer, data.unigram_counts,
                               rate_schedule=rate_schedule)
  mesh = sharding.make_mesh(config.mesh.fsdp)
  built = build_lib.build(config, vocab_size, mesh, baseline_token=data.most_frequent_token(),
                          plan=plan, phase=phase)
  return data, masker, mesh, built


def _prepared_data(config: ml_collections.ConfigDict) -> prepared.PreparedData:
  """The data, asked for once per process: process 0 prepares it (if needed); the others wait
  at the barrier, then read the same data dir (a bucket's through their own local copy)."""
  if jax.process_count() == 1:
    return prepare.prepare(*fields.data_request(config))
  data = prepare.prepare(*fields.data_request(config)) if jax.process_index() == 0 else None
  multihost_utils.sync_global_devices('mlm_jax:prepare')
  return data if data is not None else prepared.load_prepared(*fields.data_request(config))


def _first_step(config: ml_collections.ConfigDict, workdir: str) -> int:
  """The step the run goes on from: its latest checkpoint's, else a Composer checkpoint's
  (config.init.composer, read once per process) or the branched run's (config.init.branch:
  its step, which run_plan pinned), else 0."""
  latest = checkpoint.latest_step(workdir_lib.checkpoint_dir(workdir))
  if latest:
    return latest
  if config.init.branch:
    return config.init.step
  if config.init.composer:
    return composer_init.read(config.init.composer).step
  return 0


def _resume(built: build_lib.Built, checkpointer: checkpoint.Checkpointer,
            config: ml_collections.ConfigDict, data: prepared.PreparedData, plan: phases.Plan,
            phase: phases.Phase) -> tuple[Any, int, bool]:
  """(state, step, restored): this workdir's latest checkpoint, else config.init's weights
  (a Composer checkpoint's with its optimizer and step, or a branched run's whole state: the
  run goes on from there), else fresh."""
  meta, init = fields.shape_record(built.model_cfg), config.init
  fresh = built.init_state  # Made under jit straight into its sharding.
  if init.branch:  # That run's state, restored straight into this run's sharding.
    fresh = functools.partial(checkpoint.restore_state, workdir_lib.checkpoint_dir(
        os.path.expanduser(init.workdir)), init.step, built.abstract_state, meta)
  # The newest checkpoint that reads (any newer that does not is set aside), else `fresh`.
  state, start_step = checkpointer.restore_or_init(built.abstract_state, fresh, meta)
  restored = bool(start_step)
  if restored:
    logging.info('Resumed from %s at step %d', checkpointer.directory, start_step)
  elif init.branch:
    start_step = init.step
    logging.info('Branched from %s at step %d: its weights, optimizer state and step',
                 init.workdir, start_step)
  elif config.init.composer:
    # The optimizer's schedule counts from its last fresh start (build.py); the metrics' from 0.
    state, start_step = composer_init.continue_run(
        state, config.init.composer, built.model_cfg,
        schedule_offset=phases.learning_rate_offset(plan, phase),
        schedule=optimizer.run_schedule(plan.phases), train=config.train)
  elif config.init.hf_dir or config.init.workdir:
    state = init_from.initial_state(state, config, built.model_cfg, data.added_tokens())
    state = state_lib.ema_from_params(state)  # The average starts at the loaded weights.
  return state, start_step, restored


def _log_start(data: prepared.PreparedData, built: build_lib.Built, state: Any, mesh) -> None:
  logging.info('Data: %s (%d train rows, %d validation rows)', data.data_dir,
               data.stats['train']['rows'], data.stats['validation']['rows'])
  size = sharding.state_bytes(state)
  logging.info('Model: %s parameters, compute dtype %s; train state %.1f MiB, %.1f MiB on each '
               'device (mesh data=%d x fsdp=%d); %d concurrent chain(s) per step',
               f'{sum(x.size for x in jax.tree_util.tree_leaves(state.params)):,}',
               jnp.dtype(built.model_cfg.dtype).name, size['total'] / 2**20,
               size['per_device'] / 2**20, mesh.shape[sharding.DATA_AXIS],
               mesh.shape[sharding.FSDP_AXIS], built.chains)
  logging.info('Attention: %s', built.attention)


@contextlib.contextmanager
def _closing(batches, profiler: profiling.StepProfiler, log: report_lib.TrainingLog,
             checkpointer: checkpoint.Checkpointer):
  """Shuts the loop's parts down however it ends; in-flight saves still finish."""
  try:
    yield
  finally:
    batches.close()  # Stops the input worker processes.
    profiler.stop()
    log.close()
    checkpointer.wait()
    checkpointer.close()


def _finish(config: ml_collections.ConfigDict, built: build_lib.Built, state: Any, mesh,
            workdir: str, log: report_lib.TrainingLog, last_eval: dict[str, Any], *, step: int,
            start_step: int, wall_time_s: float) -> dict[str, Any]:
  """Writes summary.json and prints the run's last evaluation (process 0); returns the summary."""
  is_main = jax.process_index() == 0
  result = summary.for_run(
      config, built.model_cfg, workdir, step=step, start_step=start_step, wall_time_s=wall_time_s,
      counters=log.counters, earlier_tokens=log.earlier_tokens, is_main=is_main)
  size = sharding.state_bytes(state)
  result |= {'mesh': dict(mesh.shape), 'concurrent_chains': built.chains,
             'host_malloc': host_malloc.description(), 'state_bytes': size['total'],
             'state_bytes_per_device': size['per_device']}
  if last_eval:
    result |= summary.eval_figures(last_eval)
  if is_main:
    if last_eval:
      print(summary.eval_line(step, last_eval), flush=True)
    path = summary.write(workdir, result)
    print(f'Summary ({path}):\n{summary.dumps(result)}', flush=True)
  return result
