"""Checkpoints: the only module that imports orbax.

`WORKDIR/checkpoints/<step>/` holds the train state and a small JSON record of
what the parameters mean (model shapes, vocabulary), checked before restoring
so that a checkpoint is never loaded into a model it does not fit.

What must stay true, whatever happens to the process or the disk:
  - a checkpoint becomes `<step>/` only once complete (Orbax writes into
    `<step>.orbax-checkpoint-tmp`, which the next run removes);
  - a save that fails, or finds no room, stops the run with one line naming
    the directory and its free space, and deletes no earlier checkpoint;
  - a checkpoint that does not read is renamed `<step>.unreadable`, never
    deleted, and the run resumes from the newest one that reads;
  - rotation keeps the checkpoint a run resumed from (the last one known to
    read) and the steps it is told to keep (a run in phases: each phase's
    last, where a branch may start) besides the newest `train.keep_checkpoints`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import logging as std_logging
import os
import re
import shutil
import sys
import time
import traceback
from collections.abc import Callable
from collections.abc import Sequence
from typing import Any

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import logging
from etils import epath
from jax.experimental import multihost_utils

from mlm_jax.errors import CheckpointMismatchError
from mlm_jax.errors import CheckpointReadError
from mlm_jax.errors import CheckpointWriteError
from mlm_jax.errors import human_bytes
from mlm_jax.training import preemption

UNREADABLE_SUFFIX = '.unreadable'
# A save asks for the last checkpoint's size with this margin: one run's
# checkpoints differ in size by several percent (OCDBT packs each anew).
ROOM_MARGIN = 1.2


class Checkpointer:
  """Saves every `train.checkpoint_every` steps (and when forced), keeping the last
  `train.keep_checkpoints` and the one the run resumed from: Orbax's own
  interval and preservation policies.

  Saves are asynchronous; a failed one surfaces as CheckpointWriteError from
  the first call after it ended (should_save, save or wait).
  """

  def __init__(self, directory: str, train: ml_collections.ConfigDict,
               keep_steps: Sequence[int] = ()):
    """`keep_steps`: steps never rotated away once saved, besides the newest."""
    self.directory = os.path.abspath(directory)
    self._every, self._keep = train.checkpoint_every, train.keep_checkpoints
    self._keep_steps = list(keep_steps)
    self._in_flight: int | None = None    # The step of a save not yet known to be complete.
    self._failed = False
    self._size: int | None = None         # Bytes on disk of the newest complete checkpoint.
    _register_array_handler()
    self._policy, self._manager = self._make_manager(known_good=None)
    for logger in (logging.get_absl_logger(), std_logging.getLogger('asyncio')):
      logger.addFilter(_ORBAX_SAVE_TRACEBACKS)
    if not isinstance(sys.unraisablehook, _QuietClosedLoop):
      sys.unraisablehook = _QuietClosedLoop(sys.unraisablehook)

  def _make_manager(self, known_good: int | None) -> tuple[Any, ocp.CheckpointManager]:
    keep = [ocp.checkpoint_managers.LatestN(n=self._keep)]
    kept = self._keep_steps + ([known_good] if known_good is not None else [])
    if kept:
      keep.append(ocp.checkpoint_managers.CustomSteps(steps=kept))
    policy = ocp.checkpoint_managers.AnyPreservationPolicy(keep)
    manager = ocp.CheckpointManager(
        self.directory,
        item_handlers={'state': ocp.StandardCheckpointHandler(),
                       'meta': ocp.JsonCheckpointHandler()},
        options=ocp.CheckpointManagerOptions(
            # Only the interval: Orbax's default also saves a run's first step.
            # The loop forces the saves at the end and on a stop signal.
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(self._every),
            preservation_policy=policy, enable_async_checkpointing=True, create=True,
            cleanup_tmp_directories=True))
    return policy, manager

  def should_save(self, step: int) -> bool:
    if self._in_flight is not None and not self._manager.is_saving_in_progress():
      self._wait_in_flight()  # A save that failed stops the run now, not at the next save.
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
    """Starts an asynchronous save if `step` is due (or forced); returns whether it did.

    CheckpointWriteError, before anything is written, when the directory has
    no room for a checkpoint the size of the last one.
    """
    if step in self._manager.all_steps() or not (force or self._manager.should_save(step)):
      return False
    self._wait_in_flight()
    self._check_room(step)
    preemption.signal_hook_for_tests('save', step)
    try:
      self._manager.save(step, force=True, args=ocp.args.Composite(
          state=ocp.args.StandardSave(_tree(state)), meta=ocp.args.JsonSave(meta)))
    except Exception as e:  # Whatever the writer raises: the disk or filesystem failed.
      raise self._write_error(step, e) from e
    self._in_flight = step
    preemption.signal_hook_for_tests('saving', step)
    return True

  def restore_latest(self, state: Any, meta: dict) -> tuple[Any, int]:
    """(state, step) of the newest checkpoint that reads; (state, 0) when there is none.

    `state` gives the shardings (it may be abstract). A checkpoint that does
    not fit `meta` or the state's structure raises CheckpointMismatchError
    at once. One that does not read is set aside (renamed `<step>.unreadable`,
    with a warning) once an older one has read; when none reads, nothing is
    renamed and CheckpointReadError names each and why.
    """
    failed = []
    for step in sorted(self._manager.all_steps(), reverse=True):
      restored, reason = self._try_restore(step, state, meta)
      if restored is None:
        failed.append((step, reason))
        continue
      for bad, why in failed:
        self._set_aside(bad, why, step)
      # Rotation must not delete the one checkpoint known to read while newer ones are not.
      self._manager.close()
      self._policy, self._manager = self._make_manager(known_good=step)
      return restored, step
    if failed:
      details = '; '.join(f'step {s}: {why}' for s, why in failed)
      raise CheckpointReadError(
          f'no checkpoint in {self.directory} reads ({details}). They are left as they are: '
          'restore the files, or move them away to start again from the beginning.')
    return state, 0

  def restore_or_init(self, abstract: Any, init: Callable[[], Any], meta: dict) -> tuple[Any, int]:
    """(state, step): the newest checkpoint that reads, restored straight into the shardings of
    `abstract` (jax.ShapeDtypeStruct leaves); else (init(), 0).

    A resume never makes the fresh state it would overwrite: on a large model,
    compiling and running the initialiser costs as much as the restore.
    Errors as restore_latest.
    """
    state, step = self.restore_latest(abstract, meta)
    if step:
      return state, step
    start = time.perf_counter()
    state = init()
    logging.info('Train state initialised in %.1fs', time.perf_counter() - start)
    return state, 0

  def wait(self) -> None:
    self._wait_in_flight()

  def close(self) -> None:
    if self._failed:
      # Orbax raises a failed save again from close(); the run has already reported it.
      try:
        self._manager.close()
      except Exception:  # pylint: disable=broad-exception-caught
        pass
      return
    self._manager.close()

  # ------------------------------------------------------------ internals

  def _try_restore(self, step: int, state: Any, meta: dict) -> tuple[Any, str]:
    """(restored state, '') or (None, why it does not read), the same on every process."""
    restored, reason = _read_state(self._manager, step, state, meta, f'{self.directory}/{step}')
    if not _on_every_process(restored is not None) and restored is not None:
      restored, reason = None, 'it does not read on another process'
    return restored, reason

  def _set_aside(self, step: int, reason: str, resumed: int) -> None:
    """Renames checkpoint `step` to `<step>.unreadable` (process 0), warning in one line."""
    path = os.path.join(self.directory, str(step))
    aside, n = path + UNREADABLE_SUFFIX, 1
    while os.path.exists(aside):
      n += 1
      aside = f'{path}{UNREADABLE_SUFFIX}-{n}'
    if jax.process_index() == 0:
      os.rename(path, aside)
    if jax.process_count() > 1:
      multihost_utils.sync_global_devices(f'mlm_jax:set_aside_{step}')
    logging.warning('Checkpoint %d does not read (%s): kept aside as %s; resuming from step %d.',
                    step, reason, aside, resumed)

  def _wait_in_flight(self) -> None:
    """Waits for the save in flight; CheckpointWriteError if it failed."""
    if self._in_flight is None:
      return
    step, self._in_flight = self._in_flight, None
    try:
      self._manager.wait_until_finished()
    except Exception as e:  # Raised again from the writer's thread: the disk failed.
      raise self._write_error(step, e) from e
    self._size = _disk_bytes(os.path.join(self.directory, str(step)))

  def _check_room(self, step: int) -> None:
    """Refuses a save the disk has no room for; warns when the one after will not fit."""
    if _is_remote(self.directory):
      return
    if self._size is None:
      latest = self._manager.latest_step()
      self._size = _disk_bytes(os.path.join(self.directory, str(latest))) if latest else 0
    if not self._size:
      return
    free, need = shutil.disk_usage(self.directory).free, int(self._size * ROOM_MARGIN)
    if not _on_every_process(free >= need):  # All processes save, or none.
      latest = self._manager.latest_step()
      raise CheckpointWriteError(
          f'no room for checkpoint {step} in {self.directory}: {human_bytes(free)} free, a '
          f'checkpoint takes {human_bytes(self._size)}. Free space there (or lower '
          f'config.train.keep_checkpoints) and run the same command to resume from step '
          f'{latest}.')
    # After this save, rotation frees what it deletes.
    steps = list(self._manager.all_steps()) + [step]
    kept = self._policy.should_preserve(
        [_Info(s) for s in steps], context=ocp.checkpoint_managers.PreservationContext())
    free_after = free - self._size + self._size * kept.count(False)
    if free_after < need:
      logging.warning('%s has room for checkpoint %d but not for the next (%s free after it, a '
                      'checkpoint takes %s): free space before step %d, or the run stops there.',
                      self.directory, step, human_bytes(max(free_after, 0)), human_bytes(self._size),
                      step + self._every)

  def _write_error(self, step: int, error: Exception) -> CheckpointWriteError:
    self._failed = True
    free = 'unknown' if _is_remote(self.directory) else human_bytes(
        shutil.disk_usage(self.directory).free)
    earlier = []
    with contextlib.suppress(Exception):  # A disk that fails may not even list.
      self._manager.reload()
      earlier = [s for s in self._manager.all_steps() if s < step]
    keep = (f'checkpoint {max(earlier)} and those before it are intact' if earlier
            else 'no earlier checkpoint exists')
    return CheckpointWriteError(
        f'checkpoint {step} could not be written to {self.directory} ({free} free): '
        f'{_reason(error)}. {keep.capitalize()}; run the same command once the disk is fixed.')


def _register_array_handler() -> None:
  """How the saves of this process write jax.Arrays: replica-parallel only across processes.

  Replica-parallel saving cuts each replicated array into slices that the
  hosts holding a replica write side by side, so that with many hosts no one
  host writes the whole state. With one process every slice is written here
  anyway, and the cutting is a device op per array and replica before each
  save: this process writes whole arrays from their first replica instead.
  Across processes Orbax's own default holds (on, except on GPUs). The files
  are the same either way; a checkpoint reads whichever wrote it.
  """
  parallel = None if jax.process_count() > 1 else False   # None: Orbax's default.
  ocp.type_handlers.register_type_handler(
      jax.Array, ocp.type_handlers.ArrayHandler(use_replica_parallel=parallel), override=True)


def latest_step(directory: str) -> int:
  """The newest step saved in `directory` (0: none), by its step folders' names."""
  path = epath.Path(directory)
  if not path.is_dir():
    return 0
  return max((int(p.name) for p in path.iterdir() if p.name.isdigit()), default=0)


def check_meta(saved: dict, expected: dict, where: str) -> None:
  """Raises CheckpointMismatchError naming every field where `saved` != `expected`."""
  diff = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
  if diff:
    details = '; '.join(f'{k}: checkpoint {a!r}, config {b!r}' for k, (a, b) in diff.items())
    raise CheckpointMismatchError(
        f'checkpoint {where} does not fit this config ({details}). '
        'Use the config the run was started with, or a new --workdir.')


def _tree(state: Any) -> dict:
  tree = {'step': state.step, 'params': state.params, 'opt_state': state.opt_state}
  if getattr(state, 'ema_params', None) is not None:  # Only where kept: old checkpoints read.
    tree['ema_params'] = state.ema_params
  return tree


def restore_state(directory: str, step: int, abstract: Any, meta: dict) -> Any:
  """The train state of checkpoint `step` in `directory`, restored into the shardings of
  `abstract` (jax.ShapeDtypeStruct leaves): another run's, which a branch continues.

  Reads only: nothing in `directory` is renamed or removed. A checkpoint that
  does not fit `meta` or the state's structure raises CheckpointMismatchError,
  one that does not read CheckpointReadError, each in one line.
  """
  directory, where = os.path.abspath(directory), f'{os.path.abspath(directory)}/{step}'
  manager = ocp.CheckpointManager(
      directory, item_handlers={'state': ocp.StandardCheckpointHandler(),
                                'meta': ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(create=False))
  try:
    restored, reason = _read_state(manager, step, abstract, meta, where)
  finally:
    manager.close()
  if restored is None:
    raise CheckpointReadError(f'checkpoint {where} does not read ({reason}).')
  return restored


def _read_state(manager: ocp.CheckpointManager, step: int, state: Any, meta: dict,
                where: str) -> tuple[Any, str]:
  """(`state` with checkpoint `step`'s arrays in its shardings, '') or (None, why it does not
  read); CheckpointMismatchError at once for one that does not fit `meta` or the structure."""
  try:
    saved_meta = manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))['meta']
    saved_tree = manager.item_metadata(step)['state'].tree
  except Exception as e:  # pylint: disable=broad-exception-caught  # Any reason it does not read.
    return None, _reason(e)
  check_meta(saved_meta, meta, where)
  target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, _tree(state))
  _check_structure(target, saved_tree, where)
  try:
    return state.replace(**manager.restore(
        step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))['state']), ''
  except Exception as e:  # pylint: disable=broad-exception-caught
    return None, _reason(e)


def save_weights(directory: str, step: int, params: Any, meta: dict) -> None:
  """Writes checkpoint `step` holding only the step and `params` (host arrays) and `meta`, in
  the layout a run's checkpoints have, so restore_params (export, fine-tuning,
  config.init.workdir) reads it; a run cannot resume from it (no optimizer state)."""
  manager = ocp.CheckpointManager(
      os.path.abspath(directory),
      item_handlers={'state': ocp.StandardCheckpointHandler(),
                     'meta': ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(create=True))
  try:
    manager.save(step, force=True, args=ocp.args.Composite(
        state=ocp.args.StandardSave({'step': np.asarray(step, np.int32), 'params': params}),
        meta=ocp.args.JsonSave(meta)))
    manager.wait_until_finished()
  finally:
    manager.close()


def restore_params(directory: str, step: int | None = None,
                   item: str = 'params') -> tuple[int, Any, dict]:
  """(step, params as host numpy arrays, meta) of a checkpoint, for inference and export.

  Reads only the parameters (not the optimizer state) and needs neither the
  train state nor the devices the run was sharded over. `step` None: the latest.
  `item` 'ema_params': the run's average of them instead (FileNotFoundError in
  one line where the run kept none).
  """
  directory = os.path.abspath(directory)
  if not os.path.isdir(directory):
    raise FileNotFoundError(f'no checkpoint directory {directory}')
  manager = ocp.CheckpointManager(
      directory, item_handlers={'state': ocp.PyTreeCheckpointHandler(),
                                'meta': ocp.JsonCheckpointHandler()},
      options=ocp.CheckpointManagerOptions(create=False))
  try:
    steps = manager.all_steps()
    step = max(steps, default=None) if step is None else step
    if step not in steps:
      raise FileNotFoundError(
          f'no checkpoint of step {step} in {directory} (steps: {sorted(steps)})')
    tree = manager.item_metadata(step)['state'].tree
    if item not in tree:
      raise FileNotFoundError(
          f'checkpoint {step} of {directory} holds no {item} (its run kept no moving average: '
          'config.train.ema_decay was 0, or it was written by `average`): export its '
          'parameters without --ema, or train with config.train.ema_decay > 0.')
    saved = tree[item]
    target = {item: jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)}
    restore_args = jax.tree_util.tree_map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)  # Host arrays.
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
        meta=ocp.args.JsonRestore()))
  finally:
    manager.close()
  return step, restored['state'][item], restored['meta']


# ---------------------------------------------------------------- helpers


@dataclasses.dataclass(frozen=True)
class _Info:
  """A checkpoint as Orbax's preservation policies see it."""
  step: int
  time: datetime.datetime = dataclasses.field(
      default_factory=lambda: datetime.datetime.now(datetime.timezone.utc))
  metrics: dict | None = None


class _OrbaxSaveTracebacks(std_logging.Filter):
  """Keeps the tracebacks of a failed save off the log: Orbax logs one from each thread
  that met it, asyncio one for each of its write tasks. The Checkpointer raises
  the same error, which a command prints as one line. They show with
  --verbosity=1.
  """

  def filter(self, record: std_logging.LogRecord) -> bool:
    if record.levelno < std_logging.ERROR or not record.exc_info or logging.level_debug():
      return True
    files = [record.pathname] + [frame.filename for frame in traceback.extract_tb(
        record.exc_info[2])]
    return not any('/orbax/' in f.replace('\\', '/') for f in files)


_ORBAX_SAVE_TRACEBACKS = _OrbaxSaveTracebacks()


class _QuietClosedLoop:
  """sys.unraisablehook without the reports of writes that outlive a failed save.

  When one write of a save fails, Orbax closes the event loop the save ran
  on while TensorStore's other writes are still in flight; as each ends, its
  callback finds the loop closed and Python reports that as unraisable, a
  traceback apiece. The save's own error is reported once, by the
  Checkpointer. They show with --verbosity=1.
  """

  def __init__(self, previous: Any):
    self._previous = previous

  def __call__(self, unraisable: Any) -> None:
    tb = unraisable.exc_traceback
    if not (isinstance(unraisable.exc_value, RuntimeError) and tb is not None
            and tb.tb_frame.f_code.co_name == 'call_soon_threadsafe'
            and str(unraisable.exc_value) == 'Event loop is closed') or logging.level_debug():
      self._previous(unraisable)


def _check_structure(target: Any, saved: Any, where: str) -> None:
  """CheckpointMismatchError unless `saved` (Orbax's tree metadata) has `target`'s arrays."""
  def arrays(tree: Any) -> dict[str, Any]:  # Leaves with a shape; not empty optimizer states.
    return {k: v for k, v in ocp.tree.to_flat_dict(tree, sep='.').items() if hasattr(v, 'shape')}

  ours = arrays(ocp.tree.serialize_tree(target, keep_empty_nodes=True))
  theirs = arrays(saved)
  diffs = [f'{k} is not in the checkpoint' for k in ours if k not in theirs]
  diffs += [f'{k} is only in the checkpoint' for k in theirs if k not in ours]
  for k in ours.keys() & theirs.keys():
    a, b = ours[k], theirs[k]
    if tuple(a.shape) != tuple(b.shape) or np.dtype(a.dtype) != np.dtype(b.dtype):
      diffs.append(f'{k}: checkpoint {np.dtype(b.dtype).name}{list(b.shape)}, '
                   f'config {np.dtype(a.dtype).name}{list(a.shape)}')
  if diffs:
    more = f' (and {len(diffs) - 3} more)' if len(diffs) > 3 else ''
    raise CheckpointMismatchError(
        f'checkpoint {where} holds a train state of another structure (were the optimizer '
        f'settings changed?): {"; ".join(sorted(diffs)[:3])}{more}. Use the config the run was '
        'started with, or a new --workdir.')


def _reason(error: BaseException) -> str:
  """The first line of the innermost error; a long TensorStore chain of 'context: context:
  cause' shortened to its status and the last two links (the file, the OS error)."""
  while error.__cause__ is not None:
    error = error.__cause__
  lines = str(error).strip().splitlines()
  text = re.sub(r'\s*\[tensorstore_spec=.*$', '', lines[0] if lines else type(error).__name__)
  links = text.split(': ')
  if len(text) > 200 and len(links) > 3:
    text = ': '.join([links[0], '...'] + links[-2:])
  return text


def _disk_bytes(path: str) -> int:
  """Bytes `path` (a directory) takes on its disk: allocated blocks, not lengths."""
  total = 0
  for root, _, files in os.walk(path):
    for name in files:
      with contextlib.suppress(OSError):
        st = os.stat(os.path.join(root, name))
        total += getattr(st, 'st_blocks', 0) * 512 or st.st_size
  return total


def _on_every_process(ok: bool) -> bool:
  """Whether `ok` holds on every process of the run."""
  if jax.process_count() == 1:
    return ok
  return bool(multihost_utils.process_allgather(np.int32(ok)).all())


def _is_remote(path: str) -> bool:
  return '://' in path  # gs://..., where free space is not a question for the writer.
