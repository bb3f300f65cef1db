"""Configs validate, every field is documented, and bad values fail early by name."""

import ast
import importlib
import json
import pathlib

import numpy as np
import pytest

from configs import base
from configs import large
from mlm_jax.config import checks
from mlm_jax.config import run_plan
from mlm_jax.errors import ConfigError
from mlm_jax.runtime import platform_ops

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / 'configs'


@pytest.mark.parametrize('path', sorted(CONFIG_DIR.glob('[!_]*.py')), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
  # Every file in configs/, so that a new experiment is checked without being listed here.
  module = importlib.import_module(f'configs.{path.stem}')
  checks.validate(module.get_config(), num_devices=8)


def test_base_and_large_shapes():
  b, l = base.get_config(), large.get_config()
  assert (b.model.num_layers, b.model.hidden_size, b.model.num_heads,
          b.model.intermediate_size) == (12, 768, 12, 3072)
  assert (b.data.seq_len, b.masking.max_predictions, b.train.batch_size) == (128, 20, 256)
  b.data.seq_len = 512
  assert b.masking.max_predictions == 80
  assert (l.model.num_layers, l.model.hidden_size, l.model.num_heads,
          l.model.intermediate_size) == (24, 1024, 16, 4096)


@pytest.mark.parametrize('path', sorted(CONFIG_DIR.glob('*.py')), ids=lambda p: p.name)
def test_every_config_field_has_a_comment(path):
  lines = path.read_text().splitlines()
  for node in ast.walk(ast.parse(path.read_text())):
    if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Attribute):
      previous = lines[node.lineno - 2].strip()
      assert previous.startswith('#'), f'{path.name}:{node.lineno} has no comment above it'


@pytest.mark.parametrize('field,value,words', [
    ('model.num_heads', 5, 'config.model.hidden_size=768 is not divisible by config.model.num_heads=5'),
    ('masking.max_predictions', 200, 'config.masking.max_predictions=200'),
    ('data.seq_len', 1024, 'config.data.seq_len=1024 exceeds config.model.max_position_embeddings'),
    ('masking.random_source', 'zipf', "config.masking.random_source='zipf'"),
    ('masking.mask_prob', 0.95, 'mask_prob + random_prob'),
    ('model.dtype', 'float16', "config.model.dtype='float16'"),
    ('train.num_steps', 0, 'config.train.num_steps=0'),
    ('train.schedule', 'cosine',
     "config.train.schedule='cosine': use 'linear', 'wsd', 'one_cycle', 'constant' or 'decay'."),
    ('train.decay_shape', 'cosine', "config.train.decay_shape='cosine': use 'linear' or '1-sqrt'."),
    ('train.decay_fraction', 0.0, 'config.train.decay_fraction=0.0 must be in (0, 1]'),
    ('data.val_fraction', 0.0, 'config.data.val_fraction=0.0'),
    ('tokenizer.vocab_size', 100, 'config.tokenizer.vocab_size=100'),
    ('data.corpus', '/no/such/dir/*.txt', 'config.data.corpus'),
    ('data.corpus', '/no/such/file.txt', 'no such file'),
])
def test_invalid_values_name_the_field(field, value, words):
  config = base.get_config()
  section, name = field.split('.')
  config[section][name] = value
  with pytest.raises(ConfigError) as err:
    checks.validate(config, num_devices=8)
  assert words in str(err.value)


def test_one_cycle_needs_its_peak_inside_the_run():
  config = base.get_config()
  config.train.schedule = 'one_cycle'
  checks.validate(config, num_devices=8)
  config.train.num_steps = config.train.warmup_steps
  with pytest.raises(ConfigError,
                     match=r"'one_cycle' needs warmup_steps=10000 < num_steps=10000"):
    checks.validate(config, num_devices=8)


def test_batch_must_divide_over_devices():
  config = base.get_config()
  config.train.batch_size = 12
  with pytest.raises(ConfigError, match=r'config.train.batch_size=12 is not divisible by the 8 devices'):
    checks.validate(config, num_devices=8)
  checks.validate(config, num_devices=4)


def test_train_compiler_options_single_threaded_eigen_with_cpu_chains_only():
  # This jaxlib's CPU compiler knows the option (the step would not compile otherwise).
  assert platform_ops.train_compiler_options('cpu', 2) == {'xla_cpu_multi_thread_eigen': False}
  assert platform_ops.train_compiler_options('cpu', 1) == {}
  assert platform_ops.train_compiler_options('tpu', 2) == {}
  assert platform_ops.train_compiler_options('gpu', 2) == {}
  # An option this XLA does not know is left out rather than failing the compile.
  assert not platform_ops._cpu_compiler_accepts('xla_cpu_no_such_option', True)


def test_concurrent_chains_auto_and_explicit():
  config = base.get_config()
  config.train.batch_size = 16
  # Auto: 2 on a single CPU device (the tests run on CPU), 1 across several.
  assert platform_ops.concurrent_chains(config.train, num_devices=1) == 2
  assert platform_ops.concurrent_chains(config.train, num_devices=8) == 1
  config.train.batch_size = 3
  assert platform_ops.concurrent_chains(config.train, num_devices=1) == 1   # 3 rows do not split
  config.train.batch_size = 16
  config.train.concurrent_chains = 4
  assert platform_ops.concurrent_chains(config.train, num_devices=8) == 4
  with pytest.raises(ConfigError, match=r'x concurrent_chains=4; use a multiple of 32'):
    checks.validate(config, num_devices=8)
  config.train.concurrent_chains = -1
  with pytest.raises(ConfigError, match=r'config.train.concurrent_chains=-1'):
    checks.validate(config, num_devices=1)


def _bert_dir(directory: pathlib.Path, table: int, words: int) -> str:
  """A Hugging Face BERT directory as config.init.hf_dir reads it: config.json, a weights file
  (whose header resolve checks; its tensors are not read there) and a WordPiece vocab.txt of
  `words` ids for a table of `table` rows."""
  from safetensors.numpy import save_file
  directory.mkdir()
  (directory / 'config.json').write_text(json.dumps({
      'model_type': 'bert', 'architectures': ['BertForMaskedLM'], 'vocab_size': table,
      'hidden_size': 32, 'num_hidden_layers': 2, 'num_attention_heads': 2,
      'intermediate_size': 64, 'max_position_embeddings': 128, 'type_vocab_size': 2,
      'layer_norm_eps': 1e-12, 'hidden_dropout_prob': 0.1, 'attention_probs_dropout_prob': 0.1,
      'initializer_range': 0.02, 'hidden_act': 'gelu', 'pad_token_id': 0}))
  save_file({'unread': np.zeros(1, np.float32)}, str(directory / 'model.safetensors'))
  pieces = ['[PAD]', '[UNK]', '[CLS]', '[SEP]', '[MASK]'] + [f'w{i}' for i in range(words - 5)]
  (directory / 'vocab.txt').write_text('\n'.join(pieces) + '\n')
  return str(directory)


def test_resolve_checks_the_final_config_once_and_reads_the_tokenizer_once(tmp_path,
                                                                           monkeypatch):
  from configs import tiny
  from mlm_jax.data import tokenizer as tok_lib
  checked, read = [], []
  validate, from_path = checks.validate, tok_lib.hf_tokenizer.HFTokenizer.from_path
  monkeypatch.setattr(checks, 'validate', lambda c, **k: checked.append(c) or validate(c, **k))
  monkeypatch.setattr(tok_lib.hf_tokenizer.HFTokenizer, 'from_path',
                      lambda path: read.append(path) or from_path(path))
  config = tiny.get_config()
  assert run_plan.resolve(config, 1).config is config and len(checked) == 1
  checked.clear()
  config.init.hf_dir = _bert_dir(tmp_path / 'bert', table=400, words=300)
  resolved = run_plan.resolve(config, 1).config
  # Checked once, as the run will use it: the checkpoint's architecture, its tokenizer.
  assert checked == [resolved] and resolved.model.variant == 'bert'
  assert (resolved.model.num_layers, resolved.model.vocab_size) == (2, 400)
  assert resolved.tokenizer.model_file == str(tmp_path / 'bert' / 'vocab.txt')
  # prepare and the loop ask for the same tokenizer: the one resolve read.
  assert tok_lib.load(resolved.tokenizer.model_file).vocab_size == 300 and len(read) == 1


def test_a_tokenizer_larger_than_the_checkpoints_table_is_refused_in_one_line(tmp_path):
  from configs import tiny
  config = tiny.get_config()
  config.init.hf_dir = _bert_dir(tmp_path / 'bert', table=400, words=450)
  with pytest.raises(ConfigError, match=r'has 450 ids but the checkpoint\'s embedding '
                                                   r'table only 400 rows'):
    run_plan.resolve(config, 1)


@pytest.mark.parametrize('table,tokenizer,rows,padded', [
    (0, 1000, 1000, 1024),       # A fresh model: the tokenizer's ids (the quick start's shape).
    (30522, 30522, 30522, 30592),  # BERT's table and tokenizer.
    (50368, 50280, 50368, 50432),  # ModernBERT: a table with room beyond its tokenizer.
    (30522, 30525, 30525, 30592),  # Three words added beyond the table: exactly those rows.
])
def test_one_vocabulary_rule_sizes_every_table(table, tokenizer, rows, padded):
  from mlm_jax.data import tokenizer as tok_lib
  assert tok_lib.model_vocab_size(table, tokenizer) == rows
  assert tok_lib.padded_vocab_size(rows) == padded


def test_the_field_table_names_every_field_of_the_config_once():
  """config/fields.py has a row for each field of configs/base.py, and no other: every list of
  fields (a checkpoint's, a phase's, the shape record, saved runs' old values) reads it."""
  from configs import base
  from mlm_jax.config import fields

  def names(d, prefix=''):
    return [n for k, v in d.items() for n in (
        names(v, f'{prefix}{k}.') if isinstance(v, dict) else [prefix + k])]
  assert sorted(fields.names()) == sorted(names(base.get_config().to_dict()))
  for section in fields.TABLE.values():
    for row in section.values():
      assert row.role in fields.ROLES and (row.modern is None or row.modern in fields.ROLES)
  # What the field table derives, as the checks use it.
  assert fields.checkpoint_fields('bert')['max_position_embeddings'] == fields.DECIDES
  assert fields.checkpoint_fields('modern')['max_position_embeddings'] == fields.SUGGESTS
  assert 'scan_layers' not in fields.checkpoint_fields('bert')
  rules = fields.phase_rules('modern')
  for name in ('model.layer_norm_eps', 'model.local_attention', 'model.global_attn_every_n_layers',
               'model.hidden_size', 'tokenizer.kind', 'seed', 'mesh.fsdp'):
    assert rules[name] == fields.FIXED, name
  assert 'model.max_position_embeddings' not in rules
  assert fields.phase_rules('bert')['model.max_position_embeddings'] == fields.FIXED
  assert rules['train.optimizer'] == fields.WITH_FRESH_OPTIMIZER
  data = base.get_config().data
  assert 'num_workers' not in fields.rows_key(data) and 'seq_len' in fields.rows_key(data)
