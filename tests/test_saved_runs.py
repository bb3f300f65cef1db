"""Runs saved by earlier versions of mlm_jax still resume and export.

tests/data/saved_runs/COMMIT.json is the config.json that `python -m mlm_jax.train
--config=configs/tiny.py` wrote at that commit (309d87d: before phases, batch warm-ups,
mixture temperatures, StableAdamW and the moving average; 46bd04f: before the field table).
A field the older run lacks is read with the field table's old value (config/fields.py):
what that run did.
"""

import json
import os
import pathlib

import pytest

from mlm_jax.config import fields
from mlm_jax.config import saved
from mlm_jax.errors import ConfigError
from tests.conftest import run_training

SAVED = pathlib.Path(__file__).parent / 'data' / 'saved_runs'
COMMITS = ('309d87d', '46bd04f')


def _saved(commit: str, corpus_glob: str, data_dir: str, steps: int) -> dict:
  """The run's config.json with this machine's paths, a test's length and a smaller model of
  the same kind; every other field as the older version wrote it."""
  run = json.loads((SAVED / f'{commit}.json').read_text())
  run['data'].update(corpus=corpus_glob, data_dir=data_dir)
  run['train'].update(num_steps=steps, log_every=1, eval_every=steps, checkpoint_every=2)
  run['eval'].update(batch_size=16, max_batches=1)
  run['model'].update(num_layers=2, hidden_size=32, num_heads=2, intermediate_size=64)
  # A smaller vocabulary for a small corpus; what the run resolved from it, as it records it.
  run['tokenizer'].update(vocab_size=400)
  run['resolved'].update(vocab_size=400, padded_vocab_size=512, tokenizer_vocab_size=400,
                         data_dir=data_dir)
  return run


@pytest.mark.parametrize('commit', COMMITS)
def test_a_saved_config_reads_with_the_old_values_of_the_fields_it_lacks(commit):
  run = json.loads((SAVED / f'{commit}.json').read_text())
  config = saved.read(run, f'{commit}.json')
  old = fields.old_values()
  for name in fields.names():
    section, key = name.split('.') if '.' in name else ('', name)
    if section and key not in run[section] or not section and key not in run:
      assert (config[section] if section else config)[key] == old[name], name
  assert config.resolved.vocab_size == run['resolved']['vocab_size']  # Kept beside the config.


def test_a_saved_config_lacking_a_field_without_an_old_value_is_refused():
  run = json.loads((SAVED / '46bd04f.json').read_text())
  del run['model']['num_layers']
  with pytest.raises(ConfigError, match=r'lacks config.model.num_layers. Train again'):
    saved.read(run, 'old/config.json')


@pytest.mark.slow
@pytest.mark.parametrize('commit', COMMITS)
def test_a_run_saved_by_an_earlier_version_resumes_and_exports(commit, corpus_glob, tmp_path):
  from mlm_jax.training import checkpoint
  from mlm_jax.training import workdir as workdir_lib
  data_dir, workdir = str(tmp_path / 'data'), str(tmp_path / 'run')
  # The older run as it lies on disk: two steps trained, its own config.json.
  run = _saved(commit, corpus_glob, data_dir, steps=2)
  run_training(saved.read(run, commit), workdir)
  with open(os.path.join(workdir, 'config.json'), 'w') as f:
    json.dump(run, f)
  exported = workdir_lib.export_hf(workdir, str(tmp_path / 'hf'))
  assert exported.step == 2 and os.path.exists(tmp_path / 'hf' / 'model.safetensors')
  # The same command with more steps continues from its checkpoint.
  longer = _saved(commit, corpus_glob, data_dir, steps=4)
  summary = run_training(saved.read(longer, commit), workdir)
  assert summary['start_step'] == 2 and summary['step'] == 4
  assert checkpoint.latest_step(workdir_lib.checkpoint_dir(workdir)) == 4
  assert workdir_lib.export_hf(workdir, str(tmp_path / 'hf4')).step == 4
