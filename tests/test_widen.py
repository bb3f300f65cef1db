"""widen: a ModernBERT run tiled into a larger model as ModernBERT-large was started from base."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from mlm_jax.errors import ConfigError
from mlm_jax.training import widen
from mlm_jax.training import workdir as workdir_lib
from tests.conftest import REPO
from tests.conftest import require

require('transformers', 'torch')


def _tile_1d(old: np.ndarray, size: int) -> np.ndarray:
  """AnswerDotAI/ModernBERT src/bert_layers/initialization.py _tile_1d, mode
  tile_weights_from_middle, loop by loop."""
  n, offset = old.shape[0], (size - old.shape[0]) // 2
  result = np.zeros(size, old.dtype)
  result[offset:offset + n] = old
  for i in range(offset):
    result[offset - 1 - i] = old[n - 1 - (i % n)]
  for i in range(offset + n, size):
    result[i] = old[(i - offset) % n]
  return result


def _tile_2d(old: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
  """Its _tile_2d, mode tile_weights_from_middle (rows: torch's output features)."""
  (h, w), (new_h, new_w) = old.shape, shape
  h_off, w_off = (new_h - h) // 2, (new_w - w) // 2
  horizontal = np.zeros((h, new_w), old.dtype)
  horizontal[:, w_off:w_off + w] = old
  for i in range(w_off):
    horizontal[:, i] = horizontal[:, w_off + w - 1 - (w_off - i - 1) % w]
  for i in range(w_off + w, new_w):
    horizontal[:, i] = horizontal[:, w_off + (i - w_off) % w]
  result = np.zeros((new_h, new_w), old.dtype)
  result[h_off:h_off + h] = horizontal
  for i in range(h_off):
    result[h_off - 1 - i] = horizontal[(h - 1) - (i % h)]
  for i in range(h_off + h, new_h):
    result[i] = horizontal[(i - h_off) % h]
  return result


def _tile_parts(old: np.ndarray, shape: tuple[int, int], parts: int) -> np.ndarray:
  """Its tile_fused_qkv (3 parts) and tile_fused_glu (2): chunks of the rows, each tiled."""
  rows = shape[0] // parts
  return np.concatenate([_tile_2d(chunk, (rows, shape[1]))
                         for chunk in np.split(old, parts, axis=0)], axis=0)


def test_tiling_from_the_middle_gives_modernberts_own_test_vectors():
  # tests/test_tiling.py of AnswerDotAI/ModernBERT, its expected_middle column.
  assert widen.tile(np.array([[1, 2], [3, 4]]), (4, 4)).tolist() == [
      [4, 3, 4, 3], [2, 1, 2, 1], [4, 3, 4, 3], [2, 1, 2, 1]]
  assert widen.tile(np.arange(1, 10).reshape(3, 3), (5, 5)).tolist() == [
      [9, 7, 8, 9, 7], [3, 1, 2, 3, 1], [6, 4, 5, 6, 4], [9, 7, 8, 9, 7], [3, 1, 2, 3, 1]]
  assert widen.tile(np.arange(1, 9).reshape(4, 2), (7, 5)).tolist() == [
      [8, 7, 8, 7, 8], [2, 1, 2, 1, 2], [4, 3, 4, 3, 4], [6, 5, 6, 5, 6], [8, 7, 8, 7, 8],
      [2, 1, 2, 1, 2], [4, 3, 4, 3, 4]]
  assert widen.tile(np.array([1, 2, 3]), (8,)).tolist() == [2, 3, 1, 2, 3, 1, 2, 3]
  rng = np.random.default_rng(0)
  for old, new in (((5, 3), (12, 7)), ((4, 4), (4, 9)), ((3, 2), (10, 10))):
    x = rng.normal(size=old)
    assert np.array_equal(widen.tile(x, new), _tile_2d(x, new))
  # ModernBERT-base's 22 layers to large's 28.
  assert widen.layer_map(22, 28) == [round(i * 22 / 28) for i in range(28)]
  assert widen.layer_map(22, 28)[:6] == [0, 1, 2, 2, 3, 4]


@pytest.mark.slow
def test_a_widened_run_exports_the_tensors_modernberts_tiling_gives(modern_micro_run, tmp_path):
  """modern_micro_run (2 layers of 32, 2 heads, GLU of 64) widened by the command to 3 layers of
  48, 3 heads, GLU of 96: its Hugging Face export holds, tensor by tensor, what ModernBERT's
  tiling makes of the source's export, and it reads as a run."""
  out = str(tmp_path / 'widened')
  done = subprocess.run([sys.executable, '-m', 'mlm_jax.widen', f'--workdir={modern_micro_run}',
                         f'--out={out}', '--num_layers=3', '--hidden_size=48',
                         '--intermediate_size=96', '--num_heads=3'],
                        cwd=REPO, capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-3000:]
  assert 'new layer i from old layer [0, 1, 1]' in done.stdout
  from safetensors.numpy import load_file
  workdir_lib.export_hf(modern_micro_run, str(tmp_path / 'old'))
  run = workdir_lib.export_hf(out, str(tmp_path / 'new'))
  assert (run.model_cfg.num_layers, run.model_cfg.hidden_size, run.model_cfg.num_heads,
          run.model_cfg.intermediate_size) == (3, 48, 3, 96)
  old = load_file(str(tmp_path / 'old' / 'model.safetensors'))
  new = load_file(str(tmp_path / 'new' / 'model.safetensors'))
  assert sorted(old) != sorted(new) and all(k in new for k in old)
  expected = {}
  for name, x in old.items():
    if '.layers.' in name:
      continue
    shape = new[name].shape
    expected[name] = (np.ones(shape, x.dtype) if 'final_norm' in name
                      else _tile_1d(x, shape[0]) if x.ndim == 1 else _tile_2d(x, shape))
  for i, j in enumerate([0, 1, 1]):
    for part in ('attn_norm.weight', 'mlp_norm.weight', 'attn.Wo.weight', 'mlp.Wo.weight',
                 'attn.Wqkv.weight', 'mlp.Wi.weight'):
      source, target = f'model.layers.{j}.{part}', f'model.layers.{i}.{part}'
      if target not in new:
        assert i == 0 and part == 'attn_norm.weight'   # Layer 0 has none, as in the source.
        continue
      x, shape = old[source], new[target].shape
      expected[target] = (_tile_1d(x, shape[0]) if x.ndim == 1 else
                          _tile_parts(x, shape, 3) if 'Wqkv' in part else
                          _tile_parts(x, shape, 2) if 'Wi' in part else _tile_2d(x, shape))
  assert sorted(expected) == sorted(new)
  for name, value in expected.items():
    np.testing.assert_array_equal(new[name], value, err_msg=name)
  with open(os.path.join(out, 'config.json')) as f:
    record = json.load(f)['widened']
  assert (record['workdir'], record['layers']) == (modern_micro_run, [0, 1, 1])


@pytest.mark.slow
def test_what_does_not_widen_is_refused_in_one_line(micro_run, modern_micro_run, tmp_path):
  with pytest.raises(ConfigError, match="is a 'bert' model: widening tiles ModernBERT's layers"):
    widen.widen_run(micro_run, str(tmp_path / 'a'), {'hidden_size': 64})
  with pytest.raises(ConfigError, match=r'only grows the model: --num_layers=1 is below the '
                                        r"run's 2"):
    widen.widen_run(modern_micro_run, str(tmp_path / 'b'), {'num_layers': 1})
  with pytest.raises(ConfigError, match=r'--hidden_size=50 is not divisible by --num_heads=3'):
    widen.widen_run(modern_micro_run, str(tmp_path / 'c'), {'hidden_size': 50, 'num_heads': 3})
  assert not any(os.path.exists(tmp_path / d) for d in 'abc')   # Nothing written.
