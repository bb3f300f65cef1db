"""host_malloc: the tiny train step stops faulting in fresh pages; accelerators are left alone."""

import os
import platform
import subprocess
import sys

import pytest

from tests.conftest import REPO
from tests.conftest import xla_flags

# Runs the bert_tiny config's train step on one CPU device and prints the page
# faults per step of the quietest window after warm-up (the step's 128 MB
# temporary buffer is above glibc's mmap threshold, so by default it is mapped
# afresh every step).
_FAULTS_PER_STEP = '''
import resource, sys
from mlm_jax.runtime import host_malloc
print(host_malloc.tune(sys.argv[1] == "on"))
import jax
from configs import bert_tiny
from mlm_jax.perf import bench
from mlm_jax.runtime import sharding
from mlm_jax.training import build as build_lib
config = bert_tiny.get_config()
mesh = sharding.make_mesh()
batches = [sharding.to_global(b, mesh) for b in bench.synthetic_batches(config, 2)]
built = build_lib.build(config, config.tokenizer.vocab_size, mesh)
state = built.init_state()
per_step = []
for window in range(5):
  before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
  for i in range(2):
    state, _ = built.train_step(state, batches[i % 2], built.dropout_rng)
  jax.block_until_ready(state)
  per_step.append((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / 2)
# The first window grows the heap to its steady size (the second, on a slow
# machine), and on a busy machine a later step can still grow it once: the
# steady state is the quietest of the last three windows.
print(min(per_step[2:]))
'''

glibc_only = pytest.mark.skipif(
    platform.system() != 'Linux' or platform.libc_ver()[0] != 'glibc',
    reason='the settings are glibc mallopt parameters')


def _run(code: str, *args: str, **env: str) -> list[str]:
  # One device, and the tests' compile options (they change how the CPU code is generated,
  # not the step's buffers, whose page faults are counted).
  env = dict(os.environ, XLA_FLAGS=xla_flags(1), **env)
  out = subprocess.run([sys.executable, '-c', code, *args], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stderr[-3000:]
  return out.stdout.split('\n')


@pytest.mark.slow
@glibc_only
def test_tuned_train_step_reuses_its_buffers():
  tuned = _run(_FAULTS_PER_STEP, 'on')
  default = _run(_FAULTS_PER_STEP, 'off')
  assert tuned[0] == 'glibc: one arena, no mmap, no trim'
  assert default[0] == 'default (--notune_host_malloc)'
  tuned_faults, default_faults = float(tuned[1]), float(default[1])
  # By default about one fault per 4 KiB page of the buffer (~31,000); tuned
  # the pages of the previous step are reused.
  assert default_faults > 5000, default_faults
  assert tuned_faults < default_faults / 20, (tuned_faults, default_faults)


@glibc_only
@pytest.mark.parametrize('platforms, expected', [
    ('cpu', 'glibc: one arena, no mmap, no trim'),
    ('tpu', 'default (accelerator backend)'),
    ('cuda,cpu', 'default (accelerator backend)'),
])
def test_tune_acts_only_on_the_cpu_backend(platforms, expected):
  # Decided from JAX_PLATFORMS without starting a backend (none exists for tpu here).
  code = ('from mlm_jax.runtime import host_malloc; import jax; print(host_malloc.tune()); '
          'print(host_malloc.tune(False)); print(jax._src.xla_bridge.backends_are_initialized())')
  first, again, started = _run(code, JAX_PLATFORMS=platforms)[:3]
  assert first == again == expected  # Once per process.
  assert started == 'False'
