"""Test set-up: 8 fake CPU devices (set before jax is imported), a compilation cache shared by
the session and the commands it starts, the order modules are handed to xdist's workers in,
and small fixtures."""

import collections
import importlib.util
import os
import shutil
import tempfile

# The tests' programs are tiny and run for milliseconds: LLVM's optimisations of the CPU
# code they compile to take longer than they save (a fifth of a compile-bound test's time),
# and XLA's older elemental emitters generate a fusion's code in half the time of its MLIR
# fusion emitters (most of the tests' time is compiling). The HLO, its buffers and the
# sharding are the same; the executables' arithmetic may differ from a default build's in the
# last bits, and every run of a session compiles alike. Their matrices are too small for
# Eigen's thread pool, whose threads only contend with the other xdist worker's: each runs on
# its caller's thread.
COMPILE_FLAGS = ('--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true '
                 '--xla_cpu_use_fusion_emitters=false --xla_cpu_multi_thread_eigen=false')


def xla_flags(devices: int) -> str:
  """XLA_FLAGS for a command a test starts with `devices` CPU devices."""
  return f'--xla_force_host_platform_device_count={devices} {COMPILE_FLAGS}'


# A subprocess started by a test (its config file imports this module) keeps
# the device count the test gave it.
if '--xla_force_host_platform_device_count' not in os.environ.get('XLA_FLAGS', ''):
  os.environ['XLA_FLAGS'] = ' '.join([os.environ.get('XLA_FLAGS', ''), xla_flags(8)]).strip()
os.environ.setdefault('JAX_PLATFORMS', 'cpu')
# Every compiled program is worth keeping: most tests and commands compile the same micro
# model's programs again, and reading one back takes a fraction of compiling it on a CPU.
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS', '0')
os.environ.setdefault('JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES', '-1')

import pathlib  # noqa: E402

import pytest  # noqa: E402

from mlm_jax.config import fields
from mlm_jax.data import corpus  # noqa: E402


def write_corpus(directory: pathlib.Path, num_files: int = 4, docs_per_file: int = 250) -> str:
  """Real English prose (stdlib docstrings) as blank-line separated .txt files."""
  docs = corpus.stdlib_docstrings()
  directory.mkdir(parents=True, exist_ok=True)
  for i in range(num_files):
    chunk = [next(docs) for _ in range(docs_per_file)]
    (directory / f'part{i}.txt').write_text('\n\n'.join(chunk) + '\n')
  return str(directory / '*.txt')


@pytest.fixture(scope='session')
def corpus_glob(tmp_path_factory) -> str:
  return write_corpus(tmp_path_factory.mktemp('corpus'))


def micro_config(corpus_glob: str, data_dir: str):
  """A model small enough to compile and step in seconds on a CPU."""
  from configs import bert_tiny
  config = bert_tiny.get_config()
  config.data.corpus = corpus_glob
  config.data.data_dir = data_dir
  config.data.seq_len = 32
  config.data.val_fraction = 0.1
  config.tokenizer.vocab_size = 600
  config.masking.max_predictions = 6
  config.model.num_layers = 2
  config.model.hidden_size = 32
  config.model.num_heads = 2
  config.model.intermediate_size = 64
  config.model.max_position_embeddings = 32
  config.model.dropout_rate = 0.1  # Resume tests must cover dropout keys too.
  config.train.batch_size = 16
  config.train.num_steps = 8
  config.train.warmup_steps = 3
  config.train.log_every = 2
  config.train.eval_every = 4
  config.train.checkpoint_every = 4
  config.eval.batch_size = 16
  config.eval.max_batches = 2
  return config


def run_training(config, workdir: str, overrides=()) -> dict:
  """Trains as `python -m mlm_jax.train` does: the config resolved once for this process's
  devices and planned (run_plan.resolve), then handed to the loop; returns the run's summary."""
  import jax

  from mlm_jax.config import run_plan
  from mlm_jax.training import loop
  run = run_plan.resolve(config, jax.device_count(), overrides, workdir)
  return loop.train_and_evaluate(run, workdir)


def as_modern(config):
  """A micro_config switched to variant 'modern', with a local window (8) narrower than the rows
  and Hugging Face's LayerNorm epsilon, as the interop and fine-tuning tests want it."""
  config.model.variant, config.model.local_attention = 'modern', 8
  config.model.layer_norm_eps = 1e-5
  return config


@pytest.fixture(scope='session')
def prepared(corpus_glob, tmp_path_factory):
  from mlm_jax.data import prepare
  config = micro_config(corpus_glob, str(tmp_path_factory.mktemp('data') / 'micro'))
  return config, prepare.prepare(*fields.data_request(config))


@pytest.fixture(scope='session')
def micro_run(prepared, corpus_glob, tmp_path_factory) -> str:
  """The workdir of a micro BERT pretraining run (8 steps) on the prepared data.

  Shared by the tests that start from a trained run (fine-tuning, export): they read it and
  write elsewhere, so it stays as training left it.
  """
  config = micro_config(corpus_glob, prepared[0].data.data_dir)
  workdir = str(tmp_path_factory.mktemp('micro_run'))
  run_training(config, workdir)
  return workdir


@pytest.fixture(scope='session')
def modern_micro_run(prepared, corpus_glob, tmp_path_factory) -> str:
  """The workdir of a micro run of variant 'modern' (as_modern: a local window narrower than
  the rows), trained 4 steps and saved at step 4; read-only, as micro_run."""
  config = as_modern(micro_config(corpus_glob, prepared[0].data.data_dir))
  config.train.num_steps, config.train.eval_every, config.train.checkpoint_every = 4, 4, 4
  workdir = str(tmp_path_factory.mktemp('modern_micro_run'))
  run_training(config, workdir)
  return workdir


REPO = pathlib.Path(__file__).resolve().parent.parent


def require(*names: str) -> None:
  """Skips the calling test module unless every module in `names` is installed (an extra left
  out); looked up without importing them, so that collecting the tests stays cheap."""
  missing = [name for name in names if importlib.util.find_spec(name) is None]
  if missing:
    pytest.skip(f'needs {", ".join(missing)}', allow_module_level=True)


class Deferred:
  """A module imported at its first attribute use, inside a test, not when the tests are
  collected: every xdist worker collects every module, and torch, transformers, datasets and
  tensorflow_datasets take seconds each to import."""

  def __init__(self, name: str):
    self._name = name

  def __getattr__(self, attr: str):
    if attr.startswith('_'):  # pytest looks for markers and fixtures on every module attribute.
      raise AttributeError(attr)
    return getattr(importlib.import_module(self._name), attr)


_DIRS_OWNED: list[str] = []


def _session_dir(variable: str, prefix: str) -> None:
  """$variable: the caller's directory if named (used and kept as it is), else one of this
  session's own, removed at its end; in the environment, so that xdist's workers and the
  commands the tests start share it."""
  if not os.environ.get(variable):
    os.environ[variable] = tempfile.mkdtemp(prefix=prefix)
    _DIRS_OWNED.append(os.environ[variable])


def pytest_configure(config) -> None:
  """JAX's persistent compilation cache, and mlm_jax's cache of default data dirs (MLM_JAX_CACHE:
  the recipes' prepared rows), each in a directory of the session's own: a test run never
  writes to the user's ~/.cache/mlm_jax, nor reads what an earlier run left there.

  Neither cache changes a result: an entry is the executable the same program compiles to, or
  the rows the same data dir's fingerprint names.
  """
  _session_dir('JAX_COMPILATION_CACHE_DIR', 'mlm_jax_test_jit_cache_')
  _session_dir('MLM_JAX_CACHE', 'mlm_jax_test_data_cache_')
  import jax  # Read its flags from the environment when first imported; set them in case not.
  jax.config.update('jax_compilation_cache_dir', os.environ['JAX_COMPILATION_CACHE_DIR'])
  jax.config.update('jax_persistent_cache_min_compile_time_secs',
                    float(os.environ['JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS']))
  jax.config.update('jax_persistent_cache_min_entry_size_bytes',
                    int(os.environ['JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES']))


# The modules that hold a worker longest, longest first (as a full run's --durations on 2
# cores orders them: the pre-flight's compiles, the multi-process runs, then the others).
# xdist hands out whole modules (--dist loadscope) in collection order
# (--no-loadscope-reorder): the longest start first and the short ones fill in at the end,
# so that the workers finish together instead of one running a long module alone. A new
# module that takes more than a minute of one worker belongs in this list.
LONGEST_MODULES = (
    'test_preflight.py', 'test_multiprocess.py', 'test_evaluate.py', 'test_finetune.py',
    'test_embed.py', 'test_model_and_step.py', 'test_composer.py',
    'test_recipes.py', 'test_preemption.py', 'test_continue.py', 'test_bench.py',
    'test_attention.py', 'test_flash_attention.py', 'test_fsdp.py', 'test_train.py',
    'test_model_options.py',
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items) -> None:
  """Modules in LONGEST_MODULES order, then the others by their number of slow tests, then of
  tests (xdist's own order); counted after -m and -k have deselected.

  A stable sort: the tests of a module keep their order, and its module fixtures are
  made once as before. Only the order of modules changes, never what runs.
  """
  def module(item) -> str:
    return item.nodeid.split('::')[0]
  slow, count = collections.Counter(), collections.Counter()
  for item in items:
    count[module(item)] += 1
    slow[module(item)] += item.get_closest_marker('slow') is not None
  rank = {name: i for i, name in enumerate(LONGEST_MODULES)}

  def key(item) -> tuple:
    name = module(item)
    return rank.get(name.rsplit('/', 1)[-1], len(rank)), -slow[name], -count[name], name
  items.sort(key=key)


def pytest_unconfigure(config) -> None:
  for directory in _DIRS_OWNED:
    shutil.rmtree(directory, ignore_errors=True)


def model_config(vocab_size: int = 300, padded_vocab_size: int = 384, **fields):
  """A ModelConfig: configs/base.py's model section with `fields` changed.

  `dtype`, `sentence_pair_head` and `platform` (set by the trainer, not
  config.model; the platform is 'cpu', where the tests run, unless given) may
  be given too.
  """
  import jax.numpy as jnp

  from configs import base
  from mlm_jax import model as model_lib
  extra = {k: fields.pop(k) for k in ('sentence_pair_head',) if k in fields}
  dtype = fields.pop('dtype', jnp.float32)
  platform = fields.pop('platform', 'cpu')
  section = base.get_config().model
  section.update(fields)
  return model_lib.ModelConfig.from_config(section, vocab_size, padded_vocab_size, dtype,
                                           platform=platform, **extra)


def write_config_file(path, corpus_glob: str, data_dir: str, other: dict | None = None,
                      **train) -> str:
  """A config file for `python -m mlm_jax.train`: the micro config with overrides.

  Keyword arguments set config.train fields; `other` maps dotted names
  ('mesh.fsdp') to values.
  """
  fields = {f'train.{k}': v for k, v in train.items()} | (other or {})
  overrides = ''.join(f'  config.{k} = {v!r}\n' for k, v in fields.items())
  path.write_text(
      'import sys\n'
      f'sys.path.insert(0, {str(REPO)!r})\n'
      'from tests.conftest import micro_config\n\n'
      'def get_config():\n'
      f'  config = micro_config({corpus_glob!r}, {data_dir!r})\n'
      f'{overrides}'
      '  return config\n')
  return str(path)
