"""Fine-tuning an encoder (a pretraining run's or a published checkpoint's) with a fresh head,
predicting with it, exporting it.

  config.py     the fine-tuning config: defaults, checks, the plan it resolves to
  pretrained.py the encoder to start from: a pretraining run (--workdir) or a Hugging Face
                masked LM (--hf_dir)
  data.py       labelled files (jsonl, csv, tsv): reading, checks, encoding (numpy only)
  batches.py    the shuffled training stream and padded evaluation batches
  heads.py      the encoder with a classification head, in Hugging Face's layout
  step.py       state, losses and the jitted train and eval steps
  scores.py     accuracy, MCC, F1, Pearson and Spearman
  task_eval.py  logits of every row of a file, and their scores
  report.py     progress bar and metrics records
  model_dir.py  the output directory: writing it, loading it back (the best evaluation's model)
  loop.py       the driver (python -m mlm_jax.finetune): trains, evaluates, keeps the best
  predict.py    predictions for a file (python -m mlm_jax.predict)
"""
