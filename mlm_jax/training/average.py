"""Weight averaging after training: checkpoints of one run, or the final weights of several
runs of one shape, averaged (or TIES-merged from the checkpoint they branched from) into a new
workdir (`python -m mlm_jax.average`).

The new workdir has the layout a training run leaves (training/workdir.py):
config.json (the first source's, with an `averaged` record of the sources),
the tokenizer, and one checkpoint holding the averaged parameters. So
`export`, `finetune --workdir` and `--config.init.workdir` read it as they
read a run. It holds no optimizer state: training continues from it as a
new run (`--config.init.workdir=AVERAGED`), not by resuming in it.

What must stay true: the average is the plain mean, accumulated in float32
in the order the sources are named and divided once by their number (two
checkpoints average to exactly (a + b) / 2 in float32); `Ties` merges them
instead with training/ties.py, from a base checkpoint of the same shape;
sources (and a base) that differ in shape or tokenizer are refused in one
line, before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from mlm_jax.config import fields
from mlm_jax.errors import ConfigError
from mlm_jax.training import checkpoint as ckpt_lib
from mlm_jax.training import ties as ties_lib
from mlm_jax.training import workdir as workdir_lib

# How sources are merged (--method): their plain mean, or TIES from a base checkpoint.
METHODS = ('mean', 'ties')


@dataclasses.dataclass(frozen=True)
class Ties:
  """TIES merging (training/ties.py) of branches trained from `base`, (workdir, step or None
  for its latest checkpoint): keep the `density` largest fraction of each branch's change,
  elect signs, average what agrees, add `scale` times it to the base."""
  base: tuple[str, int | None]
  density: float = 0.2
  scale: float = 1.0

  def __post_init__(self):
    if not (isinstance(self.density, (int, float)) and 0.0 < self.density <= 1.0):
      raise ConfigError(f"--trim={self.density}: give the fraction of each branch's change "
                        "kept, in (0, 1] (TIES's k; 0.2 in the paper).")
    if not (isinstance(self.scale, (int, float)) and 0.0 < self.scale < float('inf')):
      raise ConfigError(f'--scale={self.scale}: give the factor of the merged change, > 0 '
                        "(TIES's lambda; 1 in the paper).")


def parse_base(value: str, workdir: str | None) -> tuple[str, int | None]:
  """--base as (workdir, step): 'WORKDIR', 'WORKDIR:STEP', or 'STEP' of the run `workdir`
  (--workdir) alone."""
  if value.isdigit():
    if workdir is None:
      raise ConfigError(f'--base={value} names a step, which needs --workdir (the run it is a '
                        'step of); name another run as --base=WORKDIR or WORKDIR:STEP.')
    return workdir, int(value)
  path, sep, step = value.rpartition(':')
  if sep and step.isdigit() and path:
    return path, int(step)
  if not value:
    raise ConfigError('--base is empty: name the checkpoint the merged runs were trained from, '
                      'as WORKDIR, WORKDIR:STEP or (with --workdir) STEP.')
  return value, None


@dataclasses.dataclass(frozen=True)
class Averaged:
  out_dir: str
  step: int                        # The step of the checkpoint written: the latest source's.
  sources: list[tuple[str, int]]   # (workdir, step) of each checkpoint averaged.


def average_checkpoints(workdir: str, steps: list[int], out_dir: str,
                        ties: Ties | None = None) -> Averaged:
  """Averages checkpoints `steps` of the run in `workdir` into a new workdir `out_dir` (TIES
  merges them from `ties.base` instead)."""
  if len(set(steps)) != len(steps) or not steps:
    raise ConfigError(f'--steps={",".join(map(str, steps))}: name each checkpoint once, at '
                      'least one.')
  return _average([(workdir, s) for s in steps], out_dir, ties)


def average_runs(workdirs: list[str], out_dir: str, ties: Ties | None = None) -> Averaged:
  """Averages the latest checkpoints of the runs in `workdirs` (one shape, one tokenizer); TIES
  merges them from `ties.base` instead."""
  paths = [os.path.abspath(w) for w in workdirs]
  if len(set(paths)) != len(paths) or not paths:
    raise ConfigError(f'--workdirs={",".join(workdirs)}: name each run once, at least one.')
  return _average([(w, None) for w in workdirs], out_dir, ties)


def _average(sources: list[tuple[str, int | None]], out_dir: str,
             ties: Ties | None = None) -> Averaged:
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(os.path.join(out_dir, 'config.json')) or os.path.exists(
      workdir_lib.checkpoint_dir(out_dir)):
    raise ConfigError(f'--out={out_dir} already holds a run: name a new directory.')
  first = workdir_lib.load(*sources[0])
  if ties is not None:
    return _ties(first, sources, out_dir, ties)
  total = _as_float32(first.params)
  read = [(first.workdir, first.step)]
  for workdir, step in sources[1:]:
    run = _checked(workdir_lib.load(workdir, step), first)
    total = jax.tree_util.tree_map(np.add, total, _as_float32(run.params))
    read.append((run.workdir, run.step))
  n = np.float32(len(read))
  mean = jax.tree_util.tree_map(lambda x: x / n, total)
  step = max(s for _, s in read)
  resolved = first.config.to_dict()
  resolved['averaged'] = {'sources': [{'workdir': w, 'step': s} for w, s in read]}
  return _write(out_dir, first, resolved, step, mean, read)


def _ties(first: Any, sources: list[tuple[str, int | None]], out_dir: str,
          ties: Ties) -> Averaged:
  """The sources TIES-merged from `ties.base` (all held in memory at once: the trim ranks each
  branch's whole change)."""
  base_dir, base_step = ties.base
  if not os.path.exists(os.path.join(os.path.abspath(base_dir), 'config.json')):
    raise ConfigError(f'--base={base_dir}: not a training workdir (no config.json); name the '
                      'run the merged runs were started from.')
  try:
    base = _checked(workdir_lib.load(base_dir, base_step), first, role='the base')
  except FileNotFoundError as e:  # A step without a checkpoint.
    raise ConfigError(f'--base={base_dir}{"" if base_step is None else f":{base_step}"}: {e}'
                      ) from None
  runs = [first] + [_checked(workdir_lib.load(w, s), first) for w, s in sources[1:]]
  read = [(r.workdir, r.step) for r in runs]
  if (base.workdir, base.step) in read:
    raise ConfigError(f'--base={base.workdir} step {base.step} is also a source: TIES merges '
                      'the changes of other checkpoints from it.')
  merged = ties_lib.merge(_as_float32(base.params), [_as_float32(r.params) for r in runs],
                          ties.density, ties.scale)
  step = max(s for _, s in read)
  resolved = first.config.to_dict()
  resolved['averaged'] = {'sources': [{'workdir': w, 'step': s} for w, s in read],
                          'method': 'ties', 'base': {'workdir': base.workdir, 'step': base.step},
                          'density': ties.density, 'scale': ties.scale}
  return _write(out_dir, first, resolved, step, merged, read)


def _write(out_dir: str, first: Any, resolved: dict, step: int, params: Any,
           read: list[tuple[str, int]]) -> Averaged:
  workdir_lib.record(out_dir, resolved, first.tokenizer)
  ckpt_lib.save_weights(workdir_lib.checkpoint_dir(out_dir), step, params,
                        fields.shape_record(first.model_cfg))
  return Averaged(out_dir, step, read)


def _checked(run: Any, first: Any, role: str = '') -> Any:
  """`run` (workdir_lib.TrainedRun) if it has `first`'s shape, tokenizer and parameters; else a
  one-line ConfigError naming the difference."""
  where = f'{role + " " if role else ""}{run.workdir} (step {run.step})'
  shape, first_shape = fields.shape_record(run.model_cfg), fields.shape_record(first.model_cfg)
  if shape != first_shape:
    diff = ', '.join(f'{k}: {v} vs {shape[k]}' for k, v in first_shape.items() if shape[k] != v)
    raise ConfigError(f'{where} has another shape than {first.workdir} ({diff}): only runs of '
                      'one shape average.')
  if run.tokenizer.digest() != first.tokenizer.digest():
    raise ConfigError(f'{where} has another tokenizer than {first.workdir}: only runs of one '
                      'tokenizer average (their ids mean other pieces).')
  if (jax.tree_util.tree_structure(run.params) != jax.tree_util.tree_structure(first.params)
      or any(a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(run.params),
                                                jax.tree_util.tree_leaves(first.params)))):
    raise ConfigError(f'{where} holds other parameters than {first.workdir}: only runs of one '
                      'shape average.')
  return run


def _as_float32(params: Any) -> Any:
  """Host float32 copies: the mean is accumulated in float32 whatever the saved dtype."""
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
