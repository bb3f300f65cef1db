"""Command line: python -m mlm_jax.export --workdir=runs/tiny --out=exported/.

Writes a Hugging Face model directory (BertForMaskedLM, or ModernBertForMaskedLM
for config.model.variant='modern'; safetensors, and the run's tokenizer) from a
checkpoint of a training run; --step picks one
(default: the latest); --embedding_correction replaces each token embedding
by its expectation under the run's masking. See mlm_jax/interop/export.py.
"""

from __future__ import annotations

import os

from absl import flags

from mlm_jax import cli
from mlm_jax.interop import export

_WORKDIR = flags.DEFINE_string('workdir', None, 'Workdir of a training run.')
_OUT = flags.DEFINE_string('out', None, 'Directory to write the Hugging Face model to.')
flags.mark_flags_as_required(['workdir', 'out'])
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step to export (default: the latest).')
_CORRECTION = flags.DEFINE_bool(
    'embedding_correction', False, 'Replace each token embedding by its expectation under '
    "the run's masking recipe (see mlm_jax/interop/export.py).")


def main() -> None:
  run = export.export(_WORKDIR.value, _OUT.value, _STEP.value, _CORRECTION.value)
  note = ' with embedding correction' if _CORRECTION.value else ''
  print(f'exported step {run.step} of {run.workdir}{note} to {os.path.abspath(_OUT.value)}')


if __name__ == '__main__':
  cli.run(main)
