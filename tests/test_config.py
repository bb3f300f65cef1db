"""Configs validate, every field is documented, and bad values fail early by name."""

import ast
import importlib
import pathlib

import pytest

from configs import base
from configs import large
from mlm_jax import configuration as config_lib
from mlm_jax.runtime import platform_ops

CONFIG_DIR = pathlib.Path(__file__).resolve().parent.parent / 'configs'


@pytest.mark.parametrize('path', sorted(CONFIG_DIR.glob('[!_]*.py')), ids=lambda p: p.name)
def test_shipped_configs_are_valid(path):
  # Every file in configs/, so that a new experiment is checked without being listed here.
  module = importlib.import_module(f'configs.{path.stem}')
  config_lib.validate(module.get_config(), num_devices=8)


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
     "config.train.schedule='cosine': use 'linear', 'wsd' or 'one_cycle'."),
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
  with pytest.raises(config_lib.ConfigError) as err:
    config_lib.validate(config, num_devices=8)
  assert words in str(err.value)


def test_one_cycle_needs_its_peak_inside_the_run():
  config = base.get_config()
  config.train.schedule = 'one_cycle'
  config_lib.validate(config, num_devices=8)
  config.train.num_steps = config.train.warmup_steps
  with pytest.raises(config_lib.ConfigError,
                     match=r"'one_cycle' needs warmup_steps=10000 < num_steps=10000"):
    config_lib.validate(config, num_devices=8)


def test_batch_must_divide_over_devices():
  config = base.get_config()
  config.train.batch_size = 12
  with pytest.raises(config_lib.ConfigError, match=r'config.train.batch_size=12 is not divisible by the 8 devices'):
    config_lib.validate(config, num_devices=8)
  config_lib.validate(config, num_devices=4)


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
  with pytest.raises(config_lib.ConfigError, match=r'x concurrent_chains=4; use a multiple of 32'):
    config_lib.validate(config, num_devices=8)
  config.train.concurrent_chains = -1
  with pytest.raises(config_lib.ConfigError, match=r'config.train.concurrent_chains=-1'):
    config_lib.validate(config, num_devices=1)
