"""Command line: python -m mlm_jax.predict --model=DIR --data=FILE --out=FILE.jsonl.

Writes the predicted label (with every label's probability), value (regress)
or per-word tags (tag) of each row of FILE, using a directory written by
python -m mlm_jax.finetune (the parameters of its best evaluation); see
mlm_jax/finetuning/predict.py for the format.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.finetuning import predict

_MODEL = flags.DEFINE_string('model', None, 'A fine-tuning output directory (--out of finetune).')
_DATA = flags.DEFINE_string('data', None, 'The rows to predict (.jsonl, .csv, .tsv, or a tfds '
                            'split as tfds:NAME:SPLIT).')
_OUT = flags.DEFINE_string('out', None, 'Where to write the predictions (JSON lines).')
_BATCH = flags.DEFINE_integer('batch_size', 64, 'Rows per forward pass.')
flags.mark_flags_as_required(['model', 'data', 'out'])


def main() -> None:
  rows = predict.predict(_MODEL.value, _DATA.value, _OUT.value, _BATCH.value)
  print(f'{rows} predictions written to {_OUT.value}', flush=True)


if __name__ == '__main__':
  cli.run(main)
