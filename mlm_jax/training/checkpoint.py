"""Checkpoints: the only module that imports orbax.

`WORKDIR/checkpoints/<step>/` holds the train state and a small JSON record of
what the parameters mean (model shapes, vocabulary), checked before restoring
so that a checkpoint is never loaded into a model it does not fit.
"""

from __future__ import annotations

import os
from typing import Any

import jax
import ml_collections
import orbax.checkpoint as ocp

from mlm_jax import model as model_lib


class CheckpointMismatchError(ValueError):
  """The checkpoint was written by a run with other model or vocab settings."""


class Checkpointer:
  """Saves every `train.checkpoint_every` steps (and when forced), keeping the last
  `train.keep_checkpoints`: Orbax's own interval and rotation."""

  def __init__(self, directory: str, train: ml_collections.ConfigDict):
    self.directory = os.path.abspath(directory)
    self._manager = ocp.CheckpointManager(
        self.directory,
        options=ocp.CheckpointManagerOptions(
            # Only the interval: Orbax's default also saves a run's first step.
            # The loop forces the saves at the end and on a stop signal.
            save_decision_policy=ocp.checkpoint_managers.FixedIntervalPolicy(
                train.checkpoint_every),
            max_to_keep=train.keep_checkpoints, enable_async_checkpointing=True, create=True))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def should_save(self, step: int) -> bool:
    return self._manager.should_save(step)

  def save(self, step: int, state: Any, meta: dict, *, force: bool = False) -> bool:
    """Starts an asynchronous save if `step` is due (or forced); returns whether it did."""
    if step in self._manager.all_steps():
      return False
    return self._manager.save(
        step, force=force,
        args=ocp.args.Composite(state=ocp.args.StandardSave(_tree(state)),
                                meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, state: Any, meta: dict) -> Any:
    """Restores onto the shardings of `state` (may be abstract) after checking meta."""
    saved = self._manager.restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore()))
    check_meta(saved['meta'], meta, f'{self.directory}/{step}')
    target = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, _tree(state))
    try:
      restored = self._manager.restore(
          step, args=ocp.args.Composite(state=ocp.args.StandardRestore(target)))['state']
    except ValueError as e:
      raise CheckpointMismatchError(
          f'checkpoint {self.directory}/{step} holds a train state of another structure '
          f'(were the optimizer settings changed?): {str(e).splitlines()[0]}') from e
    return state.replace(**restored)

  def wait(self) -> None:
    self._manager.wait_until_finished()

  def close(self) -> None:
    self._manager.close()


def check_meta(saved: dict, expected: dict, where: str) -> None:
  """Raises CheckpointMismatchError naming every field where `saved` != `expected`."""
  saved = model_lib.STRUCTURE_DEFAULTS | saved
  diff = {k: (saved.get(k), v) for k, v in expected.items() if saved.get(k) != v}
  if diff:
    details = '; '.join(f'{k}: checkpoint {a!r}, config {b!r}' for k, (a, b) in diff.items())
    raise CheckpointMismatchError(
        f'checkpoint {where} does not fit this config ({details}). '
        'Use the config the run was started with, or a new --workdir.')


def _tree(state: Any) -> dict:
  return {'step': state.step, 'params': state.params, 'opt_state': state.opt_state}


def restore_params(directory: str, step: int | None = None) -> tuple[int, Any, dict]:
  """(step, params as host numpy arrays, meta) of a checkpoint, for inference and export.

  Reads only the parameters (not the optimizer state) and needs neither the
  train state nor the devices the run was sharded over. `step` None: the latest.
  """
  import numpy as np  # Restored leaves are host arrays.
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
    saved = manager.item_metadata(step)['state'].tree['params']
    target = {'params': jax.tree_util.tree_map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), saved)}
    restore_args = jax.tree_util.tree_map(
        lambda _: ocp.RestoreArgs(restore_type=np.ndarray), target)
    restored = manager.restore(step, args=ocp.args.Composite(
        state=ocp.args.PyTreeRestore(item=target, restore_args=restore_args, partial_restore=True),
        meta=ocp.args.JsonRestore()))
  finally:
    manager.close()
  return step, restored['state']['params'], restored['meta']
