"""Command line: python -m mlm_jax.embed (--workdir=PRETRAIN_DIR | --hf_dir=HF_DIR) --out=DIR
--train_data=PAIRS, or --evaluate=retrieval|sts --workdir=DIR --data=D --out=RESULTS.

Trains an encoder (a pretraining run's, or a published Hugging Face masked
LM's) into an embedding model: InfoNCE over (query, positive[, hard
negatives]) pairs with the negatives of the whole global batch, gathered
from every device. PAIRS is a .jsonl or .parquet file of {query, positive,
negatives} rows, or a BEIR directory (corpus.jsonl, queries.jsonl,
qrels/train.tsv). Any field of mlm_jax/embedding/config.py can be
overridden, e.g. --config.loss.temperature=0.02, --config.model.pooling=cls,
--config.train.mini_batch_size=32 (GradCache). Running the same command
again resumes. `python -m mlm_jax.export --workdir=DIR --out=ST_DIR` writes
the sentence-transformers directory.

With --evaluate, scores a model instead (mlm_jax/embedding/suites.py): an
embed run (--workdir=DIR of this command) or the mean-pooled encoder of a
pretraining run or Hugging Face checkpoint, on a BEIR directory (retrieval:
nDCG@10, recall@100) or a file of scored sentence pairs (sts: Spearman);
--compare=st trains sentence-transformers on the embed run's data beside
it. Writes RESULTS/results.json and results.md. docs/embeddings.md.
"""

from __future__ import annotations

from absl import flags

from mlm_jax import cli
from mlm_jax.embedding import config as config_lib
from mlm_jax.embedding import loop
from mlm_jax.embedding import suites
from mlm_jax.errors import ConfigError
from mlm_jax.runtime import sharding

_CONFIG = cli.config_dict_flag(
    config_lib.get_config(), 'Embedding settings (mlm_jax/embedding/config.py); override any '
    'field with --config.a.b=value.')
_WORKDIR = flags.DEFINE_string('workdir', None, 'The pretraining run to start from (its latest '
                               'checkpoint); with --evaluate, also an embed run; or give '
                               '--hf_dir.')
_HF_DIR = flags.DEFINE_string(
    'hf_dir', None, 'A Hugging Face masked-LM directory to start from (BertForMaskedLM, '
    'RobertaForMaskedLM, ModernBertForMaskedLM, ... with its tokenizer files), or a hub id '
    'org/name[@revision] read through the Hugging Face cache; or give --workdir.')
flags.register_multi_flags_validator(
    ['workdir', 'hf_dir'], lambda f: (f['workdir'] is None) != (f['hf_dir'] is None),
    'name exactly one model: --workdir (an mlm_jax run) or --hf_dir (a Hugging Face directory).')
_OUT = flags.DEFINE_string('out', None, 'Directory for the embedding model, checkpoints and '
                           'metrics; with --evaluate, for results.json and results.md.')
flags.mark_flags_as_required(['out'])
_TRAIN = flags.DEFINE_string('train_data', None, 'Training pairs: a .jsonl or .parquet file '
                             '(query, positive, negatives) or a BEIR directory.')
_EVALUATE = flags.DEFINE_enum('evaluate', None, suites.SUITES, 'Score the model on --data '
                              'instead of training.')
_DATA = flags.DEFINE_string('data', None, 'With --evaluate: a BEIR directory (retrieval) or a '
                            '.jsonl/.csv/.tsv file of sentence pairs and scores (sts).')
_COMPARE = flags.DEFINE_enum('compare', None, suites.COMPARES, 'With --evaluate on an embed '
                             "run: also train and score sentence-transformers' peer.")
_COORDINATOR = flags.DEFINE_string(
    'coordinator_address', '', 'host:port of process 0, for a run of several processes.')
_NUM_PROCESSES = flags.DEFINE_integer('num_processes', 1, 'Number of processes of the run.')
_PROCESS_ID = flags.DEFINE_integer('process_id', 0, "This process's index in [0, num_processes).")


def main() -> None:
  if _EVALUATE.value:
    if _TRAIN.value or not _DATA.value:
      raise ConfigError('--evaluate scores a model on --data; it takes no --train_data.')
    results = suites.run_suite(_EVALUATE.value, workdir=_WORKDIR.value, hf_dir=_HF_DIR.value,
                               out_dir=_OUT.value, data=_DATA.value, compare=_COMPARE.value)
    for name, scores in results['scores'].items():
      print(f'{name}: ' + ', '.join(f'{k} {v:.4f}' for k, v in scores.items()
                                    if isinstance(v, float) and k != 'seconds'))
    return
  if not _TRAIN.value or _DATA.value or _COMPARE.value:
    raise ConfigError('training needs --train_data (--data and --compare go with --evaluate).')
  sharding.initialize_distributed(_COORDINATOR.value, _NUM_PROCESSES.value, _PROCESS_ID.value)
  loop.embed(_WORKDIR.value, _OUT.value, _TRAIN.value, _CONFIG.value, hf_dir=_HF_DIR.value)


if __name__ == '__main__':
  cli.run(main, tune_host_malloc=True, info=True)
