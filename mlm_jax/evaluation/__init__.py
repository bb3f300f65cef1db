"""Judging a pretrained encoder as the field does: a suite of tasks under a published protocol.

  suites.py     run_suite: protocol and encoder, tasks and data, the sweep, the results
                (python -m mlm_jax.evaluate)
  tasks.py      a task as data (kind, labels, metrics, dev splits); GLUE's nine
  glue_data.py  GLUE's files in their three layouts (a GLUE download, tfds, the
                Hugging Face datasets cache), checked, written as the rows finetune reads
  suite_file.py a user's own suite: tasks by their files, kind and metrics
  protocols.py  BERT's, RoBERTa's and ModernBERT's protocols and `quick`, every value with
                its source
  sweep.py      every (task, grid cell, seed) as a run kept on disk: order, resume, locks
                shared by several processes, selection, the MNLI start
  cell_run.py   our run of a cell: its fine-tuning config, finetune, scoring
  hf_peer.py    transformers' run of the same cell (--compare=hf)
  scoring.py    a task's metrics from logits, for both
  results.py    results.json, results.md, results.png
  identity.py   what the figures were computed with: the model's identity, mlm_jax's version
"""
