"""TIES merging (training/ties.py) against a numpy reference, and `average --method=ties`."""

import json
import os
import shutil
import subprocess
import sys

import jax
import numpy as np
import pytest

from mlm_jax.errors import ConfigError
from mlm_jax.training import average
from mlm_jax.training import ties
from tests.conftest import REPO


def _reference(base: dict, branches: list[dict], k: float, lam: float) -> dict:
  """TIES as the paper's Algorithm 1 states it, written out over one flat vector per model."""
  names = sorted(base)
  flat = lambda tree: np.concatenate([tree[n].ravel() for n in names])  # noqa: E731
  theta0 = flat(base)
  taus = []
  for branch in branches:
    tau = flat(branch) - theta0
    keep = max(int(k * tau.size), 1)
    cut = np.sort(np.abs(tau))[::-1][keep - 1]        # The keep-th largest magnitude.
    taus.append(np.where(np.abs(tau) >= cut, tau, np.float32(0)))
  taus = np.stack(taus)
  gamma = np.sign(taus.sum(axis=0))
  merged = np.zeros_like(theta0)
  for p in range(theta0.size):
    agreeing = [t[p] for t in taus if t[p] != 0 and np.sign(t[p]) == gamma[p]]
    merged[p] = np.float32(sum(agreeing, np.float32(0)) / max(len(agreeing), 1))
  out, at = {}, 0
  for n in names:
    size = base[n].size
    out[n] = (theta0[at:at + size] + np.float32(lam) * merged[at:at + size]).reshape(
        base[n].shape)
    at += size
  return out


def test_ties_equals_the_reference_on_random_trees():
  rng = np.random.default_rng(0)
  shapes = {'a': (7, 5), 'b': (11,), 'c': (3, 2, 4), 'd': ()}
  base = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
  branches = [{n: (x + rng.normal(size=x.shape) * s).astype(np.float32) for n, x in base.items()}
              for s in (0.1, 0.3, 1.0)]
  # Changes that cancel exactly (the elected sign is 0, the merge 0 there) and magnitudes tied
  # at the trim threshold (all kept).
  branches[1]['a'][0] = base['a'][0] - (branches[0]['a'][0] - base['a'][0])
  branches[2]['b'][:4] = base['b'][:4] + np.float32(0.5)
  for k, lam in ((0.2, 1.0), (0.5, 0.7), (1.0, 1.0), (0.01, 2.0)):
    got = ties.merge(base, branches, k, lam)
    want = _reference(base, branches, k, lam)
    for n in shapes:
      assert got[n].dtype == np.float32 and got[n].shape == base[n].shape
      np.testing.assert_allclose(got[n], want[n], rtol=1e-6, atol=1e-7, err_msg=f'{n} k={k}')
  # Where both branches are kept and cancel, the merge leaves the base (k = 1 keeps all).
  two = ties.merge(base, branches[:2], 1.0)
  np.testing.assert_array_equal(two['a'][0], base['a'][0])
  # The trim is over the whole model: k = 0.2 keeps a fifth of all entries of each branch.
  d = sum(x.size for x in base.values())
  cuts = ties.thresholds(base, branches[:1], 0.2)
  tau = np.concatenate([(branches[0][n] - base[n]).ravel() for n in base])
  assert (np.abs(tau) >= cuts[0]).sum() == int(0.2 * d)


def _branch(source: str, out: str, params) -> str:
  """A workdir holding `params` at step 8, with `source`'s config and tokenizer."""
  from mlm_jax.config import fields
  from mlm_jax.training import checkpoint
  from mlm_jax.training import workdir as workdir_lib
  os.makedirs(out)
  for name in ('config.json', 'tokenizer.model', 'tokenizer'):
    path = os.path.join(source, name)
    if os.path.isdir(path):
      shutil.copytree(path, os.path.join(out, name))
    elif os.path.exists(path):
      shutil.copy(path, os.path.join(out, name))
  run = workdir_lib.load(source)
  checkpoint.save_weights(workdir_lib.checkpoint_dir(out), 8, params,
                          fields.shape_record(run.model_cfg))
  return out


@pytest.mark.slow
def test_average_ties_merges_runs_from_their_base(micro_run, tmp_path):
  from mlm_jax.training import workdir as workdir_lib
  base = workdir_lib.load(micro_run)
  rng = np.random.default_rng(1)
  moved = [jax.tree_util.tree_map(
      lambda x: (np.asarray(x, np.float32) + rng.normal(size=x.shape) * 0.01).astype(np.float32),
      base.params) for _ in range(2)]
  runs = [_branch(micro_run, str(tmp_path / f'branch{i}'), p) for i, p in enumerate(moved)]
  out = str(tmp_path / 'merged')
  result = average.average_runs(runs, out, average.Ties((micro_run, None), 0.3, 0.9))
  assert result.step == 8 and [w for w, _ in result.sources] == runs
  merged = workdir_lib.load(out).params
  want = ties.merge(jax.tree_util.tree_map(lambda x: np.asarray(x, np.float32), base.params),
                    moved, 0.3, 0.9)
  for a, b in zip(jax.tree_util.tree_leaves(merged), jax.tree_util.tree_leaves(want)):
    np.testing.assert_array_equal(a, b)
  with open(os.path.join(out, 'config.json')) as f:
    record = json.load(f)['averaged']
  assert record['method'] == 'ties' and record['base']['workdir'] == os.path.abspath(micro_run)
  assert (record['density'], record['scale']) == (0.3, 0.9)
  # Bad input: one line each, nothing written.
  for call, words in (
      (lambda: average.Ties((micro_run, None), 0.0), '--trim=0.0'),
      (lambda: average.Ties((micro_run, None), 0.2, -1.0), '--scale=-1.0'),
      (lambda: average.parse_base('4', None), 'needs --workdir'),
      (lambda: average.average_runs(runs, str(tmp_path / 'x'),
                                    average.Ties((str(tmp_path / 'nowhere'), None))),
       'not a training workdir'),
      (lambda: average.average_runs(runs, str(tmp_path / 'x'), average.Ties((micro_run, 3))),
       'no checkpoint of step 3'),
      (lambda: average.average_runs(runs, str(tmp_path / 'x'), average.Ties((runs[0], None))),
       'is also a source')):
    with pytest.raises(ConfigError, match=None) as error:
      call()
    assert words in str(error.value) and '\n' not in str(error.value), str(error.value)
  assert not (tmp_path / 'x').exists()
  assert average.parse_base('runs/a:120', None) == ('runs/a', 120)
  assert average.parse_base('120', 'runs/a') == ('runs/a', 120)
  assert average.parse_base('runs/a', None) == ('runs/a', None)


def test_the_command_refuses_flags_that_do_not_fit_the_method(tmp_path):
  run = subprocess.run(
      [sys.executable, '-m', 'mlm_jax.average', '--workdirs=a,b', f'--out={tmp_path / "o"}',
       '--method=ties'], cwd=REPO, capture_output=True, text=True, timeout=120)
  assert run.returncode == 2 and 'Traceback' not in run.stderr, run.stderr[-2000:]
  errors = [line for line in run.stderr.splitlines() if line.startswith('error: ')]
  assert len(errors) == 1 and '--method=ties needs --base' in errors[0]
