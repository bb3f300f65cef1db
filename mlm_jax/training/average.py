"""Weight averaging after training: checkpoints of one run, or the final weights of several
runs of one shape, averaged into a new workdir (`python -m mlm_jax.average`).

The new workdir has the layout a training run leaves (training/workdir.py):
config.json (the first source's, with an `averaged` record of the sources),
the tokenizer, and one checkpoint holding the averaged parameters. So
`export`, `finetune --workdir` and `--config.init.workdir` read it as they
read a run. It holds no optimizer state: training continues from it as a
new run (`--config.init.workdir=AVERAGED`), not by resuming in it.

What must stay true: the average is the plain mean, accumulated in float32
in the order the sources are named and divided once by their number (two
checkpoints average to exactly (a + b) / 2 in float32); sources that differ
in shape or tokenizer are refused in one line, before anything is written.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import numpy as np

from mlm_jax.errors import ConfigError
from mlm_jax.training import checkpoint as ckpt_lib
from mlm_jax.training import workdir as workdir_lib


@dataclasses.dataclass(frozen=True)
class Averaged:
  out_dir: str
  step: int                        # The step of the checkpoint written: the latest source's.
  sources: list[tuple[str, int]]   # (workdir, step) of each checkpoint averaged.


def average_checkpoints(workdir: str, steps: list[int], out_dir: str) -> Averaged:
  """Averages checkpoints `steps` of the run in `workdir` into a new workdir `out_dir`."""
  if len(set(steps)) != len(steps) or not steps:
    raise ConfigError(f'--steps={",".join(map(str, steps))}: name each checkpoint once, at '
                      'least one.')
  return _average([(workdir, s) for s in steps], out_dir)


def average_runs(workdirs: list[str], out_dir: str) -> Averaged:
  """Averages the latest checkpoints of the runs in `workdirs` (one shape, one tokenizer)."""
  paths = [os.path.abspath(w) for w in workdirs]
  if len(set(paths)) != len(paths) or not paths:
    raise ConfigError(f'--workdirs={",".join(workdirs)}: name each run once, at least one.')
  return _average([(w, None) for w in workdirs], out_dir)


def _average(sources: list[tuple[str, int | None]], out_dir: str) -> Averaged:
  out_dir = os.path.abspath(out_dir)
  if os.path.exists(os.path.join(out_dir, 'config.json')) or os.path.exists(
      workdir_lib.checkpoint_dir(out_dir)):
    raise ConfigError(f'--out={out_dir} already holds a run: name a new directory.')
  first = workdir_lib.load(*sources[0])
  total = _as_float32(first.params)
  read = [(first.workdir, first.step)]
  for workdir, step in sources[1:]:
    run = workdir_lib.load(workdir, step)
    where = f'{run.workdir} (step {run.step})'
    if run.model_cfg.shape_record() != first.model_cfg.shape_record():
      diff = {k: (v, run.model_cfg.shape_record()[k])
              for k, v in first.model_cfg.shape_record().items()
              if run.model_cfg.shape_record()[k] != v}
      raise ConfigError(f'{where} has another shape than {first.workdir} ('
                        + ', '.join(f'{k}: {a} vs {b}' for k, (a, b) in diff.items())
                        + '): only runs of one shape average.')
    if run.tokenizer.digest() != first.tokenizer.digest():
      raise ConfigError(f'{where} has another tokenizer than {first.workdir}: only runs of one '
                        'tokenizer average (their ids mean other pieces).')
    if (jax.tree_util.tree_structure(run.params) != jax.tree_util.tree_structure(total)
        or any(a.shape != b.shape for a, b in zip(jax.tree_util.tree_leaves(run.params),
                                                  jax.tree_util.tree_leaves(total)))):
      raise ConfigError(f'{where} holds other parameters than {first.workdir}: only runs of one '
                        'shape average.')
    total = jax.tree_util.tree_map(np.add, total, _as_float32(run.params))
    read.append((run.workdir, run.step))
  n = np.float32(len(read))
  mean = jax.tree_util.tree_map(lambda x: x / n, total)
  step = max(s for _, s in read)
  resolved = first.config.to_dict()
  resolved['averaged'] = {'sources': [{'workdir': w, 'step': s} for w, s in read]}
  workdir_lib.record(out_dir, resolved, first.tokenizer)
  ckpt_lib.save_weights(workdir_lib.checkpoint_dir(out_dir), step, mean,
                        first.model_cfg.shape_record())
  return Averaged(out_dir, step, read)


def _as_float32(params: Any) -> Any:
  """Host float32 copies: the mean is accumulated in float32 whatever the saved dtype."""
  return jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), params)
