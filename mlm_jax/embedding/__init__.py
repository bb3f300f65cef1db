"""Embedding models: contrastive training of a pretrained encoder, its sentence-transformers
export, and retrieval and STS evaluation (python -m mlm_jax.embed; docs/embeddings.md).

  config.py     the embedding config: defaults, checks, the plan it resolves to
  data.py       pairs (jsonl, parquet), BEIR directories, STS files; encoded rows, batches
  model.py      the encoder with pooling (mean, [CLS], last token)
  loss.py       InfoNCE with the negatives of the whole global batch, gathered across devices
  step.py       state and the jitted train step, plain or GradCache
  run_dir.py    the output directory: writing it, loading it back
  loop.py       the driver (python -m mlm_jax.embed): trains, checkpoints, resumes
  inference.py  texts to vectors on the mesh
  retrieval.py  exact search on the mesh; nDCG, recall, STS correlations
  st_export.py  a sentence-transformers directory (python -m mlm_jax.export --workdir=OUT)
  st_peer.py    the same training through sentence-transformers (--compare=st)
  suites.py     run_suite: the retrieval and STS suites (python -m mlm_jax.evaluate)
"""
