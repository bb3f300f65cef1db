"""BERT encoder and MLM head as Flax Linen modules.

Shapes: B batch, T sequence length, P masked slots per row, d hidden size,
N heads, H = d / N head size, V padded vocabulary.

The encoder is the original post-LayerNorm BERT; the MLM head follows
keras_nlp's MLMHead: gather the encoder output at the masked positions only,
then dense + GELU + LayerNorm and a projection tied to the token embedding
(plus a bias). No logits are computed for unmasked positions.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

Array = jax.Array


# Options that change the parameter tree, with the value that a checkpoint
# written before the option existed implies.
STRUCTURE_DEFAULTS = {'scan_layers': False, 'sentence_pair_head': False}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  vocab_size: int            # Real vocabulary (tokenizer size).
  padded_vocab_size: int     # Embedding rows: vocab_size rounded up to 128.
  num_layers: int = 12
  hidden_size: int = 768
  num_heads: int = 12
  intermediate_size: int = 3072
  max_position_embeddings: int = 512
  type_vocab_size: int = 2
  dropout_rate: float = 0.1
  attention_dropout_rate: float = 0.1
  initializer_range: float = 0.02
  layer_norm_eps: float = 1e-12
  dtype: Any = jnp.float32   # Compute dtype; parameters are always float32.
  attention: str = 'auto'    # 'auto' | 'xla' | 'cudnn' (fused; GPU, bf16/fp16).
  scan_layers: bool = False  # One nn.scan over the blocks (params stacked).
  remat: str = 'none'        # 'none' | 'dots' | 'full': what a block keeps for backward.
  drop_token_rate: float = 0.0     # Training only: unmasked tokens dropped from the input.
  sentence_pair_head: bool = False  # Pooler + 2-way classifier on [CLS] (NSP/SOP).
  # Where activations keep their batch axis (the trainer's batch sharding, see
  # sharding.batch_sharding); None: no constraint (a model used on one device).
  batch_sharding: Any = None

  def batch_split(self, x: Array) -> Array:
    """x [B, ...] constrained to keep its batch axis split like the input batch."""
    if self.batch_sharding is None:
      return x
    return jax.lax.with_sharding_constraint(x, self.batch_sharding)

  def shape_record(self) -> dict[str, Any]:
    """What a checkpoint's parameters must agree with to be loaded into this model."""
    return {k: getattr(self, k) for k in (
        'vocab_size', 'padded_vocab_size', 'num_layers', 'hidden_size', 'num_heads',
        'intermediate_size', 'max_position_embeddings', 'type_vocab_size',
        *STRUCTURE_DEFAULTS)}

  @classmethod
  def from_config(cls, model_config, vocab_size: int, padded_vocab_size: int,
                  dtype: Any, **overrides) -> 'ModelConfig':
    """From config.model (fields it lacks, e.g. in an older run's config.json, keep defaults)."""
    fields = {f.name for f in dataclasses.fields(cls)} - {'vocab_size', 'padded_vocab_size', 'dtype'}
    given = {k: model_config[k] for k in fields if k in model_config}
    return cls(vocab_size=vocab_size, padded_vocab_size=padded_vocab_size, dtype=dtype,
               **(given | overrides))


# Logical names of parameter axes; sharding.LOGICAL_RULES maps them onto the
# mesh ('embed' onto 'fsdp'), so the model never names a mesh axis itself.
EMBED, MLP, HEADS, KV, VOCAB, TABLE = 'embed', 'mlp', 'heads', 'kv', 'vocab', 'table'


def _dense_init(cfg: ModelConfig, names: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.truncated_normal(cfg.initializer_range), names)


def _zeros(names: tuple[str, ...]):
  return nn.with_logical_partitioning(nn.initializers.zeros_init(), names)


def _layer_norm(cfg: ModelConfig, name: str) -> nn.LayerNorm:
  return nn.LayerNorm(epsilon=cfg.layer_norm_eps, dtype=cfg.dtype, name=name,
                      scale_init=nn.with_logical_partitioning(nn.initializers.ones_init(), (EMBED,)),
                      bias_init=_zeros((EMBED,)))


def _gelu(x: Array) -> Array:
  """BERT's exact GELU, x·Φ(x), written with erf as PyTorch does.

  Same function as jax.nn.gelu(approximate=False), which uses erfc; in the
  tiny config's train step on a 2-core CPU this form made each block's
  forward+backward ~1.5x faster (together with the attention below).
  """
  return 0.5 * x * (1.0 + jax.lax.erf(x * (1.0 / math.sqrt(2.0))))


class Embeddings(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, input_ids: Array, segment_ids: Array, positions: Array | None,
               deterministic: bool) -> Array:
    """input_ids, segment_ids, positions: [B, T] -> [B, T, d].

    positions=None means 0..T-1 in every row: the first T rows of the table,
    broadcast (a gather of them was a measurable part of a CPU step).
    """
    cfg = self.cfg
    token_table = nn.Embed(cfg.padded_vocab_size, cfg.hidden_size,
                           embedding_init=_dense_init(cfg, (VOCAB, EMBED)), name='token')
    x = token_table(input_ids)
    position_table = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size,
                              embedding_init=_dense_init(cfg, (TABLE, EMBED)), name='position')
    if positions is None:
      x += position_table.embedding[:input_ids.shape[1]].astype(x.dtype)
    else:
      x += position_table(positions)
    x += nn.Embed(cfg.type_vocab_size, cfg.hidden_size,
                  embedding_init=_dense_init(cfg, (TABLE, EMBED)), name='segment')(segment_ids)
    x = _layer_norm(cfg, 'layer_norm')(cfg.batch_split(x))
    return nn.Dropout(cfg.dropout_rate)(x, deterministic=deterministic)


def resolve_attention(attention: str, platform: str, dtype: Any,
                      attention_dropout_rate: float = 0.0) -> str:
  """config.model.attention for a platform: 'xla' or 'cudnn'.

  'auto' is cuDNN's fused (flash) kernel on NVIDIA GPUs in 16-bit when
  training has no attention dropout (the fused call has none), else XLA.
  """
  if attention != 'auto':
    return attention
  fused = (platform == 'gpu' and jnp.dtype(dtype) in (jnp.bfloat16, jnp.float16)
           and attention_dropout_rate == 0.0)
  return 'cudnn' if fused else 'xla'


def uses_cudnn_attention(cfg: ModelConfig) -> bool:
  """The fused cuDNN (flash) kernel: asked for, or 'auto' resolved to it on this backend."""
  return resolve_attention(cfg.attention, jax.default_backend(), cfg.dtype,
                           cfg.attention_dropout_rate) == 'cudnn'



def softmax_attention(q: Array, k: Array, v: Array, key_mask: Array,
                      dropout=lambda w: w) -> Array:
  """softmax(q·kᵀ/√H, keys masked)·v for q, k, v [B, T, N, H] and key_mask [B, T] -> [B, T, N, H].

  The queries are scaled (not the [B, N, T, T] scores), masked keys get a
  large negative bias, and the unnormalised weights exp(s - max s) meet v
  before the division by their sum: one pass less over the scores than
  softmax-then-product, in both directions. `dropout` acts on those weights,
  which is dropout on the probabilities (it commutes with the division).
  The max is a constant to differentiation (softmax does not depend on it).
  Scores, weights and sums are float32 whatever the compute dtype.
  """
  scores = jnp.einsum('bqnh,bknh->bnqk', q * (1.0 / math.sqrt(q.shape[-1])), k)
  scores = scores.astype(jnp.float32) + jnp.where(key_mask, 0.0, -1e9)[:, None, None, :]
  weights = jnp.exp(scores - jax.lax.stop_gradient(jnp.max(scores, axis=-1, keepdims=True)))
  total = jnp.swapaxes(jnp.sum(weights, axis=-1), 1, 2)[..., None]       # [B, T, N, 1]
  out = jnp.einsum('bnqk,bknh->bqnh', dropout(weights).astype(v.dtype), v)
  return (out.astype(jnp.float32) / total).astype(v.dtype)


class SelfAttention(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
    """x: [B, T, d], key_mask: [B, T] bool (True = real token) -> [B, T, d].

    Real tokens come first in every row and padding last, so the mask is also
    a length per row: the fused cuDNN kernel takes those lengths rather than
    a dense [B, 1, T, T] mask (slow there). Attention-probability dropout is
    not in jax.nn.dot_product_attention: with it, training takes the XLA path.
    """
    cfg = self.cfg
    head_dim = cfg.hidden_size // cfg.num_heads
    proj = lambda name: nn.DenseGeneral(
        (cfg.num_heads, head_dim), dtype=cfg.dtype, kernel_init=_dense_init(cfg, (EMBED, HEADS, KV)),
        bias_init=_zeros((HEADS, KV)), name=name)
    q, k, v = (cfg.batch_split(proj(name)(x)) for name in ('query', 'key', 'value'))  # [B, T, N, H]
    dropout = 0.0 if deterministic else cfg.attention_dropout_rate
    if dropout == 0.0 and uses_cudnn_attention(cfg):
      lengths = jnp.sum(key_mask, axis=-1, dtype=jnp.int32)
      out = jax.nn.dot_product_attention(q, k, v, key_value_seq_lengths=lengths,
                                         implementation='cudnn')
    else:
      out = softmax_attention(q, k, v, key_mask,
                              lambda w: nn.Dropout(dropout)(w, deterministic=dropout == 0.0))
    return nn.DenseGeneral(cfg.hidden_size, axis=(-2, -1), dtype=cfg.dtype,
                           kernel_init=_dense_init(cfg, (HEADS, KV, EMBED)),
                           bias_init=_zeros((EMBED,)), name='out')(out)


class TransformerBlock(nn.Module):
  """Post-LN block: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, x: Array, key_mask: Array, deterministic: bool) -> Array:
    cfg = self.cfg
    dense = lambda features, names, name: nn.Dense(
        features, dtype=cfg.dtype, kernel_init=_dense_init(cfg, names),
        bias_init=_zeros(names[-1:]), name=name)
    x = cfg.batch_split(x)
    h = SelfAttention(cfg, name='attention')(x, key_mask, deterministic)
    h = nn.Dropout(cfg.dropout_rate)(cfg.batch_split(h), deterministic=deterministic)
    x = _layer_norm(cfg, 'attention_layer_norm')(x + h)
    h = _gelu(cfg.batch_split(dense(cfg.intermediate_size, (EMBED, MLP), 'intermediate')(x)))
    h = dense(cfg.hidden_size, (MLP, EMBED), 'output')(h)                   # h: [B, T, d_ff] above
    h = nn.Dropout(cfg.dropout_rate)(cfg.batch_split(h), deterministic=deterministic)
    return cfg.batch_split(_layer_norm(cfg, 'output_layer_norm')(x + h))


_REMAT_POLICIES = {
    'full': None,  # Keep only each block's input; recompute the rest.
    'dots': jax.checkpoint_policies.dots_with_no_batch_dims_saveable,  # Keep matmul outputs.
}


def _block_class(cfg: ModelConfig):
  if cfg.remat == 'none':
    return TransformerBlock
  # Argument 3 (self counts as 0) is the Python bool `deterministic`.
  return nn.remat(TransformerBlock, policy=_REMAT_POLICIES[cfg.remat], static_argnums=(3,))


class _ScannedBlock(nn.Module):
  """One step of nn.scan over the blocks: (x, key_mask) -> (x, x or None)."""

  cfg: ModelConfig
  deterministic: bool
  emit: bool  # Also return every block's output (stacked by the scan).

  @nn.compact
  def __call__(self, x: Array, key_mask: Array):
    x = _block_class(self.cfg)(self.cfg, name='block')(x, key_mask, self.deterministic)
    return x, (x if self.emit else None)


class Encoder(nn.Module):
  cfg: ModelConfig

  @nn.compact
  def __call__(self, input_ids: Array, segment_ids: Array, attention_mask: Array,
               deterministic: bool = True, return_all_layers: bool = False,
               positions: Array | None = None) -> Array:
    """[B, T] ids -> [B, T] contextual embeddings [B, T, d].

    `positions` [B, T]: each token's position in the original row (default
    0..T-1); DropToken passes the positions of the tokens it kept.
    With return_all_layers: [L + 1, B, T, d], the embeddings' output (index 0)
    and then every block's, the last being the usual output.
    """
    cfg = self.cfg
    x = Embeddings(cfg, name='embeddings')(input_ids, segment_ids, positions, deterministic)
    key_mask = attention_mask.astype(bool)
    if cfg.scan_layers:
      # Parameters stacked on a leading 'layers' axis: one block is compiled.
      blocks = nn.scan(_ScannedBlock, variable_axes={'params': 0},
                       split_rngs={'params': True, 'dropout': True}, in_axes=nn.broadcast,
                       length=cfg.num_layers, metadata_params={nn.PARTITION_NAME: 'layers'})
      out, every = blocks(cfg, deterministic, return_all_layers, name='layers')(x, key_mask)
      return jnp.concatenate([x[None], every]) if return_all_layers else out
    layers = [x]
    for i in range(cfg.num_layers):
      x = _block_class(cfg)(cfg, name=f'layer_{i}')(x, key_mask, deterministic)
      layers.append(x)
    return jnp.stack(layers) if return_all_layers else x


def stack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """Per-layer params (encoder/layer_i) -> the scan layout (encoder/layers/block, [L, ...])."""
  encoder = dict(params['encoder'])
  blocks = [encoder.pop(f'layer_{i}') for i in range(num_layers)]
  encoder['layers'] = {'block': jax.tree_util.tree_map(lambda *xs: jnp.stack(xs), *blocks)}
  return {**params, 'encoder': encoder}


def unstack_layers(params: dict[str, Any], num_layers: int) -> dict[str, Any]:
  """The scan layout -> per-layer params (what export, import and probes read)."""
  encoder = dict(params['encoder'])
  stacked = encoder.pop('layers')['block']
  for i in range(num_layers):
    encoder[f'layer_{i}'] = jax.tree_util.tree_map(lambda x, i=i: x[i], stacked)
  return {**params, 'encoder': encoder}


def drop_tokens(batch: dict[str, Array], rate: float, rng: Array) -> dict[str, Array]:
  """DropToken: the encoder input without a fraction `rate` of the unmasked tokens.

  Each row keeps T' = T - round(rate * (T - P)) tokens, in their order and
  with their original positions: [CLS] and every masked slot are always
  kept, padding is dropped first, then random unmasked tokens. Returns the
  shortened input_ids/segment_ids/attention_mask/positions [B, T'] and
  masked_positions re-indexed into the kept tokens.
  """
  b, t = batch['input_ids'].shape
  p = batch['masked_positions'].shape[1]
  keep = t - int(round(rate * (t - p)))
  rows = jnp.arange(b)[:, None]
  protected = jnp.zeros((b, t), bool).at[:, 0].set(True)
  protected = protected.at[rows, batch['masked_positions']].max(batch['masked_weights'] > 0)
  score = jax.random.uniform(rng, (b, t))                       # Random order of the rest,
  score = jnp.where(batch['attention_mask'] > 0, score, 2.0)    # padding first to go,
  score = jnp.where(protected, -1.0, score)                     # protected never.
  kept = jnp.sort(jnp.argsort(score, axis=1)[:, :keep], axis=1)  # [B, T'] old positions
  gather = lambda x: jnp.take_along_axis(x, kept, axis=1)
  new_index = jnp.zeros((b, t), jnp.int32).at[rows, kept].set(jnp.arange(keep))
  return {'input_ids': gather(batch['input_ids']), 'segment_ids': gather(batch['segment_ids']),
          'attention_mask': gather(batch['attention_mask']), 'positions': kept,
          'masked_positions': jnp.take_along_axis(new_index, batch['masked_positions'], axis=1)}


class MLMHead(nn.Module):
  """Gather at masked positions -> dense + GELU + LayerNorm -> tied logits."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, sequence: Array, masked_positions: Array, embedding: Array) -> Array:
    """sequence [B, T, d], masked_positions [B, P], embedding [V, d] -> logits [B, P, V]."""
    cfg = self.cfg
    x = cfg.batch_split(jnp.take_along_axis(sequence, masked_positions[..., None], axis=1))  # [B, P, d]
    x = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=_dense_init(cfg, (EMBED, MLP)),
                 bias_init=_zeros((MLP,)), name='transform')(x)
    x = _layer_norm(cfg, 'layer_norm')(_gelu(x))
    bias = self.param('output_bias', _zeros((VOCAB,)), (cfg.padded_vocab_size,))
    logits = jnp.einsum('bpd,vd->bpv', x, embedding.astype(cfg.dtype))
    logits = logits.astype(jnp.float32) + bias
    if cfg.padded_vocab_size > cfg.vocab_size:
      # Rows past the tokenizer's vocabulary exist only for alignment.
      real = jnp.arange(cfg.padded_vocab_size) < cfg.vocab_size
      logits = jnp.where(real, logits, -1e9)
    return logits


class SentencePairHead(nn.Module):
  """BERT's pooler (dense + tanh on [CLS]) and a 2-way classifier (NSP or SOP)."""

  cfg: ModelConfig

  @nn.compact
  def __call__(self, sequence: Array, deterministic: bool) -> Array:
    """sequence [B, T, d] -> logits [B, 2]."""
    cfg = self.cfg
    x = nn.Dense(cfg.hidden_size, dtype=cfg.dtype, kernel_init=_dense_init(cfg, (EMBED, MLP)),
                 bias_init=_zeros((MLP,)), name='pooler')(sequence[:, 0])
    x = nn.Dropout(cfg.dropout_rate)(jnp.tanh(x), deterministic=deterministic)
    return nn.Dense(2, kernel_init=_dense_init(cfg, (MLP, None)), bias_init=_zeros((None,)),
                    name='classifier')(x).astype(jnp.float32)


class BertForMLM(nn.Module):
  """model.apply(params, batch) -> MLM logits [B, P, V] at the masked slots.

  `method=BertForMLM.pretrain` gives every training output (MLM logits, and
  the sentence-pair logits when the model has that head); for probing,
  `method=BertForMLM.all_layers` gives every layer's output and
  `method=BertForMLM.mlm_logits` runs the head on any one of them.
  """

  cfg: ModelConfig

  def setup(self):
    self.encoder = Encoder(self.cfg)
    self.mlm_head = MLMHead(self.cfg)
    if self.cfg.sentence_pair_head:
      self.sentence_pair = SentencePairHead(self.cfg)

  def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    return self.pretrain(batch, deterministic)['mlm_logits']

  def pretrain(self, batch: dict[str, Array], deterministic: bool = True) -> dict[str, Array]:
    """{'mlm_logits': [B, P, V]} (+ 'sentence_pair_logits': [B, 2] with that head)."""
    inputs = {k: batch[k] for k in ('input_ids', 'segment_ids', 'attention_mask',
                                    'masked_positions')}
    positions = None
    if self.cfg.drop_token_rate > 0 and not deterministic and 'masked_weights' in batch:
      inputs = drop_tokens(batch, self.cfg.drop_token_rate, self.make_rng('dropout'))
      positions = inputs['positions']
    sequence = self.encoder(inputs['input_ids'], inputs['segment_ids'], inputs['attention_mask'],
                            deterministic, positions=positions)
    out = {'mlm_logits': self.mlm_logits(sequence, inputs['masked_positions'])}
    if self.cfg.sentence_pair_head:
      out['sentence_pair_logits'] = self.sentence_pair(sequence, deterministic)
    return out

  def all_layers(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    """[L + 1, B, T, d]: the embeddings' output, then each block's."""
    return self.encoder(batch['input_ids'], batch['segment_ids'], batch['attention_mask'],
                        deterministic, return_all_layers=True)

  def mlm_logits(self, sequence: Array, masked_positions: Array) -> Array:
    """sequence [B, T, d], masked_positions [B, P] -> logits [B, P, V] (tied embedding)."""
    # Boxed with its logical axis names while the model is being initialised.
    embedding = nn.unbox(self.encoder.variables['params']['embeddings']['token']['embedding'])
    return self.mlm_head(sequence, masked_positions, embedding)
