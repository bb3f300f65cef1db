"""Command line: python -m mlm_jax.export --workdir=runs/tiny --out=exported/
(a pretraining run) or --model=runs/tiny_topic --out=exported/ (a fine-tuned model).

Writes a Hugging Face model directory (safetensors, config and the run's
tokenizer): from a training run's checkpoint, the masked LM of its
config.model.variant (BertForMaskedLM, RobertaForMaskedLM or
ModernBertForMaskedLM), see training/workdir.py's export_hf and
mlm_jax/interop/mlm_export.py;
--embedding_correction replaces each token embedding by its expectation
under the run's masking. From a fine-tuning's output (finetune's --out), the
variant's ForSequenceClassification (classify, pair, regress) or
ForTokenClassification (tag) with its labels, see mlm_jax/finetuning/classifier_export.py.
--step picks a checkpoint (default: the latest); --ema writes the run's
exponential moving average of the parameters (config.train.ema_decay > 0)
instead of the parameters. From an embed run (python -m mlm_jax.embed's
--out, given as --workdir), a sentence-transformers directory, see
mlm_jax/embedding/st_export.py.
"""

from __future__ import annotations

import os

from absl import flags

from mlm_jax import cli
from mlm_jax.embedding import run_dir as embed_run_dir
from mlm_jax.embedding import st_export
from mlm_jax.errors import ConfigError
from mlm_jax.finetuning import classifier_export
from mlm_jax.training import workdir as workdir_lib

_WORKDIR = flags.DEFINE_string('workdir', None, 'Workdir of a training run (a masked LM), or '
                               'the --out of an embed run (a sentence-transformers model).')
_MODEL = flags.DEFINE_string('model', None, 'Output directory of a fine-tuning (--out of '
                             'finetune): a sequence or token classifier.')
_OUT = flags.DEFINE_string('out', None, 'Directory to write the Hugging Face model to.')
flags.mark_flags_as_required(['out'])
flags.register_multi_flags_validator(
    ['workdir', 'model'], lambda f: (f['workdir'] is None) != (f['model'] is None),
    'name exactly one of --workdir (a pretraining run) and --model (a fine-tuned model).')
_STEP = flags.DEFINE_integer('step', None, 'Checkpoint step to export (default: the latest of a '
                             'training run, the best of a fine-tuned model).')
_CORRECTION = flags.DEFINE_bool(
    'embedding_correction', False, 'Replace each token embedding by its expectation under '
    "the run's masking recipe (see mlm_jax/interop/mlm_export.py).")

_EMA = flags.DEFINE_bool('ema', False, "Export the run's moving average of the parameters "
                         '(trained with config.train.ema_decay > 0) instead of the parameters.')


def main() -> None:
  if _MODEL.value:
    if _EMA.value:
      raise ConfigError('--ema applies to a masked LM (--workdir), not to a '
                                      'fine-tuned model (--model).')
    if _CORRECTION.value:
      raise ConfigError('--embedding_correction applies to a masked LM (--workdir), not to a '
                       'fine-tuned model (--model).')
    model = classifier_export.export(_MODEL.value, _OUT.value, _STEP.value)
    architecture = classifier_export.architecture(model)
    print(f'exported step {model.step} of {model.out_dir} ({model.task}, '
          f'{len(model.labels or [0])} outputs) as {architecture} to {os.path.abspath(_OUT.value)}')
    return
  if embed_run_dir.is_embed_run(_WORKDIR.value):
    if _EMA.value or _CORRECTION.value:
      raise ConfigError('--ema and --embedding_correction apply to a masked LM; an embed run '
                        'exports as a sentence-transformers directory.')
    embedded = st_export.export(_WORKDIR.value, _OUT.value, _STEP.value)
    print(f'exported step {embedded.step} of {embedded.out_dir} ({embedded.record["pooling"]} '
          f'pooling) as a sentence-transformers directory to {os.path.abspath(_OUT.value)}')
    return
  run = workdir_lib.export_hf(_WORKDIR.value, _OUT.value, _STEP.value, _CORRECTION.value,
                              ema=_EMA.value)
  note = ' (its moving average)' if _EMA.value else ''
  note += ' with embedding correction' if _CORRECTION.value else ''
  print(f'exported step {run.step} of {run.workdir}{note} to {os.path.abspath(_OUT.value)}')


if __name__ == '__main__':
  cli.run(main)
