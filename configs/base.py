"""BERT-base (Devlin et al., 2019): L=12, d=768, 12 heads, d_ff=3072, T=128.

Optimiser settings follow the BERT paper: Adam(W) with lr 1e-4, beta1 0.9,
beta2 0.999, weight decay 0.01, 10k warm-up steps then linear decay over
1M steps of 256 sequences.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  """BERT-base: every field of every section, each commented in its section's function."""
  config = ml_collections.ConfigDict()
  # Seed for parameter init, data order, masks and dropout.
  config.seed = 0
  # Text source, packing and the held-out split.
  config.data = _data()
  # The tokenizer: trained on the corpus, or given (a file, or config.init's).
  config.tokenizer = _tokenizer()
  # Dynamic masking (BERT 80/10/10 recipe); P follows config.data.seq_len.
  config.masking = _masking(config.data)
  # Sentence-pair objective besides MLM (off as in RoBERTa).
  config.sentence_pair = _sentence_pair()
  # Host input pipeline (reading, batching and masking; see pipeline_bench).
  config.input = _input()
  # Encoder shape and numerics.
  config.model = _model()
  # How devices are arranged: a (data, fsdp) mesh over all devices of all hosts.
  config.mesh = _mesh()
  # Optimiser, schedule and loop cadence.
  config.train = _train()
  # Where the parameters of a new run come from (a resumed run ignores both).
  config.init = _init()
  # Held-out evaluation.
  config.eval = _eval()
  # Performance: a jax.profiler trace of a few steps, and the peak for MFU.
  config.profile = _profile()
  # A run in phases (mlm_jax/config/phases.py, docs/recipes.md): a tuple of dicts,
  # each with a 'name', its length as 'steps' or 'tokens', 'overrides' of
  # this config ({section: {field: value}}, applied on top of the phase
  # before it) and optionally 'fresh_optimizer': True. The phases run in
  # order in one workdir; the step count, the optimizer's moments and the
  # learning-rate schedule carry over. Empty: one phase, this config.
  config.phases = ()
  return config


def _data() -> ml_collections.ConfigDict:
  """config.data: text source, packing and the held-out split."""
  data = ml_collections.ConfigDict()
  # Text files: paths, directories or globs, comma separated, of .txt (plain
  # text) and .jsonl (one JSON object per line) files, each possibly .gz,
  # .parquet files and directories written by datasets' save_to_disk; local
  # or bucket URLs (gs://... where gcsfs is installed).
  # Empty (and no tfds_name): the embedded default corpus (docstrings of the
  # Python standard library).
  data.corpus = ''
  # How a text file is split into documents: 'blank_line' or 'file'.
  data.document_split = 'blank_line'
  # The field of a .jsonl line, the column of a parquet file or datasets
  # directory, or the feature of a tfds record, that holds the document text.
  data.text_key = 'text'
  # Pre-tokenized input: the column of a parquet file or datasets directory
  # that holds a document's token ids, made with the tokenizer
  # config.tokenizer.model_file names. Empty: read text.
  data.ids_key = ''
  # A weighted mixture of corpora instead of data.corpus: a tuple of
  # dicts, each with a corpus (or tfds_name, and any of text_key, ids_key,
  # document_split, split, tfds_data_dir), a 'weight' > 0 (optional with a
  # temperature below) and optionally
  # 'max_epochs' (a cap, 0: none), 'tokens' (the size the temperature sees,
  # for a sample of a larger corpus) and a 'name' for the reports, e.g.
  # ({'corpus': 'domain/*.jsonl', 'weight': 0.8}, {'corpus': 'web/*.parquet',
  # 'weight': 0.2}). Empty: one corpus (data/mixture.py).
  data.sources = ()
  # Sampling temperature tau of that mixture. None: the sources' weights as
  # given. tau > 0: each source's share p ∝ weight * n^(1/tau), n its train
  # tokens as prepared (a weight then multiplies a prior into it; left out,
  # it is 1): tau=1 draws in proportion to size, larger tau more evenly,
  # tau < 1 favours the large sources. mmBERT's 0.7, 0.5, 0.3 are exponents
  # (p ∝ n^0.7, flatter each phase): here 1/0.7, 1/0.5, 1/0.3.
  data.temperature = ml_collections.config_dict.placeholder(float)
  # A tfds text dataset already prepared on disk in array_record format (e.g.
  # 'wikipedia/20230601.en'), read instead of data.corpus.
  data.tfds_name = ''
  # Where that tfds dataset is prepared. Empty: tfds's default data dir.
  data.tfds_data_dir = ''
  # Split of that tfds dataset to read, in tfds slicing syntax ('train[:10%]').
  data.split = 'train'
  # Processes that tokenize and write rows while preparing. 0: one per core.
  data.num_workers = 0
  # Where the tokenizer and packed rows are stored. Empty: a cache directory
  # keyed by the corpus and the settings below (~/.cache/mlm_jax/...).
  data.data_dir = ''
  # Also export the packed rows as a tfds dataset in array_record format
  # (DATA_DIR/tfds/mlm_rows/1.0.0, for tools that read tfds); training reads
  # only the .npy rows. Asked of a data dir prepared without it, it is added.
  data.tfds_export = False
  # Tokens per row, [CLS] and [SEP] included (T).
  data.seq_len = 128
  # How documents become rows of T ids: 'packed' (documents one after another
  # with [SEP] between them, every row full: RoBERTa's FULL-SENTENCES) or
  # 'document_chunks' (each document cut into chunks of T - 2 ids, one row
  # each, [CLS] chunk [SEP] then [PAD]: BERT's and Ettin's rows; data/packing.py).
  data.row_layout = 'packed'
  # 'document_chunks': a document's later chunk shorter than this takes a
  # share of the chunk before it (Ettin's backfill: 512). 0: none.
  data.chunk_min_tokens = 0
  # 'document_chunks': a document's later chunk shorter than this is dropped
  # (Ettin: 128). 0: none.
  data.chunk_drop_tokens = 0
  # Fraction of documents held out for evaluation.
  data.val_fraction = 0.02
  # Seed of the train/validation split of documents.
  data.split_seed = 0
  return data


def _tokenizer() -> ml_collections.ConfigDict:
  """config.tokenizer: the tokenizer: trained on the corpus, or given (a file, or config.init's)."""
  tokenizer = ml_collections.ConfigDict()
  # What is trained when no tokenizer is given: 'sentencepiece' (unigram or
  # BPE with byte fallback), 'wordpiece' (BERT's) or 'bpe' (byte-level, as
  # RoBERTa's and ModernBERT's), the latter two with Hugging Face tokenizers.
  tokenizer.kind = 'sentencepiece'
  # Vocabulary size, special tokens included.
  tokenizer.vocab_size = 32000
  # kind 'sentencepiece': its model type, 'unigram' or 'bpe'.
  tokenizer.model_type = 'unigram'
  # kind 'sentencepiece': fraction of characters the vocabulary must cover
  # (the rest: byte fallback).
  tokenizer.character_coverage = 0.9995
  # kinds 'wordpiece' and 'bpe': lowercase the text first (an uncased model).
  tokenizer.lowercase = False
  # At most this many lines are sampled to train the tokenizer (a line over
  # sentencepiece's 4192-byte limit counts once per piece it is cut into).
  tokenizer.max_sentences = 2_000_000
  # A tokenizer to use instead of training one: an mlm_jax sentencepiece
  # model (e.g. WORKDIR/tokenizer.model of an earlier run), a Hugging Face
  # tokenizer.json, a WordPiece vocab.txt, or a directory holding one. The
  # settings above are then ignored. config.init.hf_dir and
  # config.init.workdir set it to their model's tokenizer.
  tokenizer.model_file = ''
  # A file of domain words, one per line, added as whole tokens to the
  # tokenizer of config.init's model; its embeddings grow, each new row the
  # mean of the rows of the pieces that spelled the word before.
  tokenizer.add_tokens = ''
  return tokenizer


def _masking(data: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  """config.masking: dynamic masking (BERT's 80/10/10 recipe); `data`: config.data, whose seq_len P follows."""
  masking = ml_collections.ConfigDict()
  # Static number of masked slots per row (P): follows data.seq_len as 5T/32,
  # i.e. BERT's 20 for T=128 and 80 for T=512, unless set explicitly.
  masking.max_predictions = data.get_ref('seq_len') * 5 // 32
  # Fraction of maskable tokens selected per row (exact count per row).
  masking.select_rate = 0.15
  # How the selection rate moves during the run (or phase): 'constant'
  # (select_rate throughout), 'linear' (from select_rate to final_select_rate
  # over rate_change_tokens, then held) or 'step' (select_rate, then
  # final_select_rate from rate_change_tokens on). max_predictions must hold
  # the highest rate.
  masking.rate_schedule = 'constant'
  # The rate a 'linear' or 'step' schedule goes to, in (0, 1].
  masking.final_select_rate = 0.0
  # Tokens from the start of the run (or of the phase that sets them) at which
  # the rate reaches final_select_rate; 0: the end of the run or phase.
  masking.rate_change_tokens = 0
  # Of the selected tokens: fraction replaced by [MASK].
  masking.mask_prob = 0.8
  # Of the selected tokens: fraction replaced by a random token (rest: kept).
  masking.random_prob = 0.1
  # Distribution of random replacements: 'unigram' (corpus counts) or 'uniform'.
  masking.random_source = 'unigram'
  # What is selected: 'token' (BERT), 'whole_word' (all pieces of a word,
  # words starting at sentencepiece's '▁' pieces) or 'span' (SpanBERT).
  masking.mode = 'token'
  # Span mode: span lengths ~ Geometric(p) on {1, 2, ...} (SpanBERT: 0.2).
  masking.span_p = 0.2
  # Span mode: longest span, in tokens (SpanBERT: 10).
  masking.span_max_length = 10
  return masking


def _sentence_pair() -> ml_collections.ConfigDict:
  """config.sentence_pair: a sentence-pair objective besides MLM (off, as in RoBERTa)."""
  sentence_pair = ml_collections.ConfigDict()
  # 'none', 'nsp' (next sentence prediction, BERT) or 'sop' (sentence order
  # prediction, ALBERT): rows become [CLS] A [SEP] B [SEP] with a label each.
  sentence_pair.task = 'none'
  # Weight of the pair classification loss added to the MLM loss.
  sentence_pair.loss_weight = 1.0
  return sentence_pair


def _input() -> ml_collections.ConfigDict:
  """config.input: the host input pipeline (reading, batching and masking; see pipeline_bench)."""
  input = ml_collections.ConfigDict()
  # Grain worker processes that read and mask batches (0: threads of the
  # training process). Batches are the same for any count.
  input.worker_count = 0
  # Chunks of about 1024 rows computed ahead, per worker.
  input.prefetch = 2
  return input


def _model() -> ml_collections.ConfigDict:
  """config.model: the encoder: shape, numerics, attention, positions."""
  model = ml_collections.ConfigDict()
  # Encoder (model/config.py VARIANTS): 'bert' (post-LN, learned positions,
  # segments; Hugging Face BertForMaskedLM) or 'modern' (ModernBERT: pre-LN,
  # GeGLU, rotary positions, local and global attention, no biases; Hugging
  # Face ModernBertForMaskedLM). configs/modern_*.py set it.
  model.variant = 'bert'
  # Embedding rows the model predicts over (before padding to a multiple of
  # 128). 0: the tokenizer's vocabulary. A checkpoint of config.init sets it
  # (ModernBERT's table is larger than its tokenizer).
  model.vocab_size = 0
  # Number of transformer blocks (L).
  model.num_layers = 12
  # Model width (d).
  model.hidden_size = 768
  # Attention heads; must divide hidden_size.
  model.num_heads = 12
  # MLP width (d_ff).
  model.intermediate_size = 3072
  # Longest row the model takes (bert: size of its learned position table);
  # must be >= data.seq_len.
  model.max_position_embeddings = 512
  # Segment (token type) vocabulary (bert only). 0: no token-type table
  # (DistilBERT's layout; exported as DistilBertForMaskedLM).
  model.type_vocab_size = 2
  # Dropout on embeddings, attention output and MLP output (modern: on the
  # embeddings and inside the MLP, as ModernBERT's embedding/mlp_dropout).
  model.dropout_rate = 0.1
  # Dropout on attention probabilities (modern: also on the attention output,
  # as ModernBERT's attention_dropout). 0, unlike BERT's 0.1, as MosaicBERT,
  # ModernBERT and Cramming train: it lets attention compile to the fused
  # kernels (cuDNN on GPUs, splash attention on TPUs), and held-out
  # [MASK]-slot accuracy did not suffer at equal steps (docs/training.md).
  model.attention_dropout_rate = 0.0
  # Dropout on the attention block's output projection alone, in both
  # encoders, on top of the dropouts above (FlexBERT's attn_out_dropout_prob:
  # 0.1 in ModernBERT's, Ettin's and mmBERT's training yamls). It acts after
  # the attention kernel, so every fused kernel still serves. Not exported:
  # Hugging Face's ModernBERT has one attention_dropout for the probabilities
  # and the output, and BERT's hidden_dropout_prob is dropout_rate above.
  model.attention_output_dropout_rate = 0.0
  # Std of the truncated-normal initialiser.
  model.initializer_range = 0.02
  # LayerNorm epsilon (1e-12 as in BERT; ModernBERT's is 1e-5).
  model.layer_norm_eps = 1e-12
  # Compute dtype: 'auto' (float32 on CPU, bfloat16 on GPU/TPU), 'float32'
  # or 'bfloat16'. Parameters are always float32.
  model.dtype = 'auto'
  # Attention kernel (model/attention/): 'dense' (ours, softmax over a dense
  # mask), 'jax_xla' (jax.nn.dot_product_attention's XLA path, dense mask),
  # 'cudnn' (NVIDIA GPUs, 16-bit), 'flash' (ours in Pallas, NVIDIA GPUs:
  # windows and documents), 'splash' (TPUs) or 'blocked' (XLA, O(T·window)
  # for local layers). 'auto' picks splash attention on TPUs ('jax_xla' for
  # global rows under 1,024 tokens without documents); on GPUs in bfloat16
  # cuDNN for global layers and 'flash' for local ones and for documents
  # apart; 'blocked' for local layers elsewhere and ours for the rest, and
  # only the kernels with dropout
  # ('dense', 'blocked') when attention_dropout_rate > 0. A kernel
  # that cannot take a call's mask hands it to another; the run's log says
  # which kernel each kind of layer compiled to, and why.
  model.attention = 'auto'
  # Keep packed documents apart: a token attends only to tokens of its own
  # document (document ids come from the row's [SEP]s). Not with
  # sentence_pair.task, whose two segments must see each other. Off: on the
  # quick start it learned as much either way, and on GPUs it takes global
  # layers off cuDNN's kernel; on, a model reads single documents better
  # (docs/long_context.md).
  model.document_mask = False
  # Positions (position table, rotary angles) restart at 0 at each document's
  # first token in a packed row, instead of counting from the row's start.
  model.restart_positions = False
  # Compile one block and nn.scan it over the layers (faster compiles of deep
  # models; parameters stored stacked, converted on export).
  model.scan_layers = False
  # Rematerialisation of each block in the backward pass: 'none', 'dots'
  # (keep matmul outputs, recompute the rest) or 'full' (keep only the
  # block's input): less memory, more compute.
  model.remat = 'none'
  # DropToken: fraction of the unmasked tokens left out of the encoder input
  # during training (masked tokens and [CLS] are always kept; positions are
  # kept). Evaluation sees whole rows. 0 disables.
  model.drop_token_rate = 0.0
  # The fields below are read by variant 'modern' only (ModernBERT's values).
  # Layers 0, n, 2n, ... attend to the whole row; the others locally.
  model.global_attn_every_n_layers = 3
  # Width of a local layer's window, in tokens: each token sees the tokens at
  # most local_attention // 2 positions away. Even.
  model.local_attention = 128
  # Rotary position base (theta) of the global layers.
  model.global_rope_theta = 160_000.0
  # Rotary position base (theta) of the local layers.
  model.local_rope_theta = 10_000.0
  return model


def _mesh() -> ml_collections.ConfigDict:
  """config.mesh: how devices are arranged: a (data, fsdp) mesh over all devices of all hosts."""
  mesh = ml_collections.ConfigDict()
  # Devices that split the parameters and optimizer state among themselves
  # (FSDP / ZeRO-3); must divide the device count and model.hidden_size. The
  # batch is split over all devices either way; 1 = plain data parallelism.
  mesh.fsdp = 1
  return mesh


def _train() -> ml_collections.ConfigDict:
  """config.train: optimiser, schedule, batch and loop cadence."""
  train = ml_collections.ConfigDict()
  # Global batch size (rows per step, over all devices and hosts).
  train.batch_size = 256
  # Total optimiser steps.
  train.num_steps = 1_000_000
  # Split each global batch into this many micro-batches inside the step
  # (same update, less memory); batch_size must divide by devices x this.
  train.grad_accum_steps = 1
  # Batch warm-up: the global batch grows from batch_warmup_start rows to
  # batch_size over this many tokens (rows x seq_len) from the run's start,
  # a start size at a time, each size for as many steps (as FlexBERT's
  # packer); a step fills whole micro-batches (grad_accum_steps of them make
  # the full batch), so the compiled step stays the same. 0: no warm-up.
  train.batch_warmup_tokens = 0
  # The global batch at the start of the warm-up: a multiple of
  # batch_size / grad_accum_steps that divides batch_size.
  train.batch_warmup_start = 0
  # Split each (micro-)batch into this many parts whose forward/backward
  # passes run side by side in one step (same update): XLA's CPU runtime then
  # keeps several cores busy. 0 = auto: 2 on a single CPU device, else 1.
  train.concurrent_chains = 0
  # Peak learning rate.
  train.learning_rate = 1e-4
  # Steps of linear warm-up from 0 to the peak ('one_cycle': a cosine rise).
  train.warmup_steps = 10_000
  # Learning-rate schedule after warm-up: 'linear' (BERT: linear decay to 0
  # at num_steps), 'wsd' (warmup-stable-decay: the peak until the last
  # decay_fraction of the steps, then a decay to 0) or 'one_cycle' (optax's
  # cosine one-cycle, from peak/25 up to the peak at warmup_steps, then down
  # to ~0).
  train.schedule = 'linear'
  # In a run of phases (config.phases), a phase's schedule spans its own
  # steps, and two more shapes serve: 'constant' (warm-up, then the peak to
  # the phase's end) and 'decay' (from the peak down over the whole phase, in
  # decay_shape, to final_lr_ratio x the peak).
  # 'wsd': fraction of num_steps spent decaying to 0 (Hägele et al., 2024:
  # about 20% matches a cosine schedule).
  train.decay_fraction = 0.2
  # 'wsd': shape of that decay, 'linear' (Cramming) or '1-sqrt' (ModernBERT).
  train.decay_shape = 'linear'
  # 'wsd' and 'decay': the rate they end at, as a fraction of the peak (Ettin
  # decays to half its rate).
  train.final_lr_ratio = 0.0
  # 'adamw', or 'stable_adamw' (ModernBERT's: AdamW whose learning rate is
  # divided, per tensor, by max(1, RMS of g / sqrt(v_hat)): no step explodes
  # when a gradient outgrows Adam's estimate of it). Both read the fields below.
  train.optimizer = 'adamw'
  # AdamW decoupled weight decay (not applied to biases and LayerNorm).
  train.weight_decay = 0.01
  # Adam beta1.
  train.adam_b1 = 0.9
  # Adam beta2.
  train.adam_b2 = 0.999
  # Adam epsilon.
  train.adam_eps = 1e-6
  # Clip gradients to this global norm (0 disables clipping).
  train.grad_clip_norm = 1.0
  # Decay of an exponential moving average of the parameters, kept beside them
  # (checkpointed, evaluated as ema_* at each evaluation, exported with
  # `export --ema`); in [0, 1), e.g. 0.999. 0 = no average (no memory, no cost).
  train.ema_decay = 0.0
  # Log train metrics every this many steps.
  train.log_every = 100
  # Evaluate on the validation split every this many steps (and at the end).
  train.eval_every = 10_000
  # Save a checkpoint every this many steps (and at the end).
  train.checkpoint_every = 10_000
  # Number of most recent checkpoints kept.
  train.keep_checkpoints = 3
  # Also write the logged scalars as TensorBoard event files in WORKDIR/tb.
  train.tensorboard = True
  return train


def _init() -> ml_collections.ConfigDict:
  """config.init: where the parameters of a new run come from (a resumed run ignores them).

  Each decides the architecture, shape, vocabulary and positions (hf_dir and
  workdir the tokenizer too); the config gives the recipe (optimizer,
  schedule, masking, batch, data, seq_len up to the checkpoint's positions).
  The optimizer starts fresh, but for a Composer checkpoint's (init.composer)
  and a branch of a run (init.branch).
  """
  init = ml_collections.ConfigDict()
  # A Hugging Face directory to continue pretraining from (BertForMaskedLM,
  # RobertaForMaskedLM or ModernBertForMaskedLM in safetensors, with its
  # tokenizer files), e.g. a published checkpoint or one written by
  # `python -m mlm_jax.export`. Empty: random init. Or a hub id,
  # org/name[@revision], read through the Hugging Face cache (the run records
  # org/name@commit); a pytorch_model.bin is read as safetensors are.
  init.hf_dir = ''
  # An mlm_jax run directory whose latest checkpoint's weights (not its
  # optimizer or step) start this run, e.g. on a new corpus.
  init.workdir = ''
  # The checkpoint of init.workdir to start from (0: its latest).
  init.step = 0
  # Branch init.workdir's run at init.step: carry everything a resume carries
  # (weights, optimizer moments and step, moving average), so this run goes on
  # from that step as that run would have, its train.num_steps and config.phases
  # counting that run's steps too; e.g. decay branches of one trunk, each in its
  # own workdir, then merged (docs/recipes.md). False: the weights only, the
  # optimizer fresh at step 0.
  init.branch = False
  # A Composer training checkpoint of FlexBERT (ModernBERT, Ettin, mmBERT) to
  # continue: a local .pt, a bucket URL (gs://...) or a hub file
  # org/name[@revision]/path/in/repo.pt. Its weights, and where the file holds
  # them StableAdamW's moments and its step: the run goes on from that step
  # (train.num_steps and config.phases count the file's steps too). Its
  # tokenizer is not in the file: with init.hf_dir (a directory or hub id)
  # set too, that model supplies only its tokenizer files; else give
  # tokenizer.model_file. Not with init.workdir.
  init.composer = ''
  return init


def _eval() -> ml_collections.ConfigDict:
  """config.eval: held-out evaluation."""
  evaluation = ml_collections.ConfigDict()
  # Rows per evaluation batch (global).
  evaluation.batch_size = 256
  # At most this many evaluation batches (0: the whole validation split).
  evaluation.max_batches = 0
  # Seed of the fixed evaluation masks.
  evaluation.mask_seed = 1234
  return evaluation


def _profile() -> ml_collections.ConfigDict:
  """config.profile: a jax.profiler trace of a few steps, and the peak for MFU."""
  profile = ml_collections.ConfigDict()
  # First traced step (step 1 is the first update and includes compilation).
  profile.start_step = 10
  # Number of steps traced into WORKDIR/profile (0: no trace).
  profile.num_steps = 0
  # Also trace Python calls (shows host-side stalls; makes the trace far larger).
  profile.trace_python = False
  # Peak TFLOP/s of one device, for the MFU in WORKDIR/summary.json. 0: look
  # the chip up in mlm_jax/runtime/hardware.py (an unknown chip gets no MFU).
  profile.peak_tflops = 0.0
  return profile
