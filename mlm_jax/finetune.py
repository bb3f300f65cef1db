"""Command line: python -m mlm_jax.finetune (--workdir=PRETRAIN_DIR | --hf_dir=HF_DIR)
--out=DIR --task=TASK --train_data=FILE --eval_data=FILE.

Fine-tunes an encoder with a fresh head: a pretraining run's (--workdir) or
a published Hugging Face masked LM's (--hf_dir: a BertForMaskedLM,
RobertaForMaskedLM or ModernBertForMaskedLM directory in safetensors with its
tokenizer files, e.g. bert-base-uncased as downloaded). TASK is classify,
pair, regress or tag (docs/finetuning.md describes the files; a tfds split
prepared on disk is named tfds:NAME:SPLIT, e.g. tfds:glue/sst2:train).

By default a run takes 3 epochs but at least 400 steps
(--config.train.num_epochs, --config.train.min_steps, or
--config.train.num_steps to name them), evaluates once per epoch (5 to 20
times in all; --config.train.eval_every), and keeps the parameters of its
best evaluation (--config.train.best_metric; the task's main score by
default) in DIR/best, which predict and export use. Any field of
mlm_jax/finetuning/config.py can be overridden, e.g.
--config.train.learning_rate=3e-5. Running the same command again resumes.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.finetuning import config as config_lib
from mlm_jax.finetuning import data
from mlm_jax.finetuning import loop
from mlm_jax.runtime import sharding

_CONFIG = cli.config_dict_flag(
    config_lib.get_config(), 'Fine-tuning settings (mlm_jax/finetuning/config.py); override '
    'any field with --config.a.b=value.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The pretraining run to start from (its latest '
                               'checkpoint); or give --hf_dir.')
_HF_DIR = flags.DEFINE_string(
    'hf_dir', None, 'A Hugging Face masked-LM directory to start from: config.json, '
    'model.safetensors and the tokenizer files it was published with (BertForMaskedLM, '
    'RobertaForMaskedLM, ModernBertForMaskedLM), or a hub id org/name[@revision] read through '
    'the Hugging Face cache; or give --workdir.')
flags.register_multi_flags_validator(
    ['workdir', 'hf_dir'], lambda f: (f['workdir'] is None) != (f['hf_dir'] is None),
    'name exactly one model to fine-tune: --workdir (an mlm_jax pretraining run) or --hf_dir '
    '(a Hugging Face masked-LM directory).')
_OUT = flags.DEFINE_string('out', None, 'Directory for the fine-tuned model, checkpoints and '
                           'metrics.')
_TASK = flags.DEFINE_enum('task', None, data.TASKS, 'What the head predicts.')
_TRAIN = flags.DEFINE_string('train_data', None, 'Labelled training file (.jsonl, .csv, .tsv) '
                             'or tfds split prepared as array_record (tfds:NAME:SPLIT, e.g. '
                             'tfds:glue/sst2:train).')
_EVAL = flags.DEFINE_string('eval_data', None, 'Labelled evaluation file (.jsonl, .csv, .tsv) '
                            'or tfds split (tfds:NAME:SPLIT); the best model is chosen on it.')
flags.mark_flags_as_required(['out', 'task', 'train_data', 'eval_data'])
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', '', 'host:port of process 0, for a run of several processes.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Number of processes of the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, "This process's index in [0, num_processes).")


def main() -> None:
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  loop.finetune(_WORKDIR.value, _OUT.value, _TASK.value, _TRAIN.value, _EVAL.value, _CONFIG.value,
                hf_dir=_HF_DIR.value)


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True, info=True)
