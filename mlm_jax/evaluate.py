"""Command line: python -m mlm_jax.evaluate --suite=glue (--workdir=RUN | --hf_dir=DIR)
--out=DIR [--tasks=cola,sst2,...] [--protocol=NAME|FILE.json] [--data=DIR|tfds|hf]
[--compare=hf].

Fine-tunes the encoder on every task of the suite under a published protocol
(bert, roberta, modernbert; quick, the default off an accelerator), each
grid cell and seed a fine-tuning kept under OUT/cells, and writes
OUT/results.json, OUT/results.md and OUT/results.png. The same command run
again continues a stopped sweep and never runs a finished cell again.
--compare=hf runs the same cells through transformers' Trainer on the model
exported to Hugging Face's format, as a second column. --suite=FILE.json
runs a user's own tasks; --suite=retrieval or sts is mlm_jax/embedding's.
docs/evaluation.md describes the protocols and their sources.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.errors import ConfigError
from mlm_jax.evaluation import suites
from mlm_jax.runtime import sharding

_SUITE = flags.DEFINE_string('suite', None, 'glue, a suite file (.json: your own tasks), or '
                             'retrieval / sts (mlm_jax/embedding).')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The pretraining run to evaluate (its latest '
                               'checkpoint); or give --hf_dir.')
_HF_DIR = flags.DEFINE_string('hf_dir', None, 'A Hugging Face masked-LM directory, or a hub id '
                              'org/name[@revision] read through the Hugging Face cache.')
flags.register_multi_flags_validator(
    ['workdir', 'hf_dir'], lambda f: (f['workdir'] is None) != (f['hf_dir'] is None),
    'name exactly one model to evaluate: --workdir (an mlm_jax pretraining run) or --hf_dir '
    '(a Hugging Face masked-LM directory).')
_OUT = flags.DEFINE_string('out', None, 'Directory of the sweep: its cells and results.')
flags.mark_flags_as_required(['suite', 'out'])
_TASKS = flags.DEFINE_list('tasks', None, "GLUE's tasks to run (default: all nine): cola, "
                           'sst2, mrpc, stsb, qqp, mnli, qnli, rte, wnli.')
_PROTOCOL = flags.DEFINE_string('protocol', None, 'bert, roberta, modernbert, quick, or a '
                                'protocol file (.json); default: quick on a CPU, bert on an '
                                'accelerator.')
_DATA = flags.DEFINE_string('data', None, "Where GLUE is: a GLUE download directory "
                            "(CoLA/train.tsv, ...), 'tfds' (glue/*, the default) or 'hf' (the "
                            "Hugging Face datasets cache of nyu-mll/glue).")
_TFDS_DATA_DIR = flags.DEFINE_string('tfds_data_dir', None, "With --data=tfds: where glue/* is "
                                     "prepared (default: tfds's).")
_COMPARE = flags.DEFINE_string('compare', None, "'hf': the same cells through transformers' "
                               'Trainer, beside ours.')
_KEEP = flags.DEFINE_bool('keep_models', False, "Keep every cell's fine-tuned parameters (by "
                          'default only those other tasks start from).')
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', '', 'host:port of process 0, for a run of several processes.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Number of processes of the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, "This process's index in [0, num_processes).")
_EMBEDDING_SUITES = ('retrieval', 'sts')


def main() -> None:
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  if _SUITE.value in _EMBEDDING_SUITES:
    run_embedding_suite()
    return
  suites.run_suite(_SUITE.value, workdir=_WORKDIR.value, hf_dir=_HF_DIR.value, out_dir=_OUT.value,
                   data=_DATA.value, protocol=_PROTOCOL.value, tasks=_TASKS.value,
                   compare=_COMPARE.value, keep_models=_KEEP.value,
                   tfds_data_dir=_TFDS_DATA_DIR.value)


def run_embedding_suite() -> dict:
  """--suite=retrieval|sts: mlm_jax/embedding's suites (contrastive sentence embeddings)."""
  try:
    from mlm_jax.embedding import suites as embedding_suites  # pylint: disable=import-outside-toplevel
  except ModuleNotFoundError as e:
    if e.name not in ('mlm_jax.embedding', 'mlm_jax.embedding.suites'):
      raise
    raise ConfigError(f'--suite={_SUITE.value} is run by mlm_jax/embedding/suites.py, which '
                      'this installation does not have yet.') from None
  return embedding_suites.run_suite(_SUITE.value, workdir=_WORKDIR.value, hf_dir=_HF_DIR.value,
                                    out_dir=_OUT.value, data=_DATA.value or '',
                                    compare=_COMPARE.value)


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True, info=True)
