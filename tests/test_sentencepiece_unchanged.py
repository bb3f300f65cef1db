"""The default sentencepiece path is unchanged by the tokenizer seam: same tokenizer, rows, losses.

The figures below were recorded with the code before the seam (one tokenizer
class with special ids fixed at 0-4), on this synthetic corpus, which numpy's
seeded generator makes the same on any machine. The tokenizer's and the rows'
bytes must match exactly; the losses of the first 8 steps to float32 rounding
(sums may differ in their last bits between CPUs).
"""

from __future__ import annotations

import glob
import hashlib
import json
import pathlib

import numpy as np
import pytest

from tests.conftest import micro_config
from tests.conftest import run_training

RECORDED_LOSSES = [6.385907173156738, 6.400411605834961, 6.3932414054870605, 6.331435203552246,
                   6.268971920013428, 6.214271068572998, 6.2123565673828125, 6.161749362945557]
RECORDED_ROWS_SHA256 = '374ad23f17edb84687e0e814a0c3cbba59d98b568f83161bb00551558cb9d874'
RECORDED_TOKENIZER_SHA256 = 'b3e925301e049d75d7690270a6bf6b9e1f128831ca3c610b00b5858d4dd3ec87'


def synthetic_corpus(directory: pathlib.Path) -> str:
  """600 documents of pseudo-words with a Zipf-like frequency, from a seeded generator."""
  rng = np.random.default_rng(1234)
  letters = np.array(list('abcdefghijklmnopqrstuvwxyz'))
  words = [''.join(rng.choice(letters, rng.integers(2, 9))) for _ in range(400)]
  directory.mkdir(parents=True, exist_ok=True)
  docs = []
  for _ in range(600):
    n = int(rng.integers(10, 80))
    docs.append(' '.join(words[i] for i in rng.zipf(1.3, n) % len(words)).capitalize() + '.')
  (directory / 'part0.txt').write_text('\n\n'.join(docs) + '\n')
  return str(directory / '*.txt')


@pytest.mark.slow
def test_sentencepiece_tokenizer_rows_and_losses_are_as_recorded(tmp_path):
  config = micro_config(synthetic_corpus(tmp_path / 'corpus'), str(tmp_path / 'data'))
  config.train.log_every = 1
  config.train.concurrent_chains = 1
  run_training(config, str(tmp_path / 'run'))
  with open(tmp_path / 'data' / 'tokenizer.model', 'rb') as f:
    assert hashlib.sha256(f.read()).hexdigest() == RECORDED_TOKENIZER_SHA256
  rows = hashlib.sha256()
  for path in sorted(glob.glob(str(tmp_path / 'data' / 'rows' / '*'))):
    with open(path, 'rb') as f:
      rows.update(f.read())
  assert rows.hexdigest() == RECORDED_ROWS_SHA256
  with open(tmp_path / 'run' / 'metrics.jsonl') as f:
    losses = [r['loss'] for r in map(json.loads, f) if 'loss' in r and 'step' in r]
  np.testing.assert_allclose(losses, RECORDED_LOSSES, rtol=2e-6)
