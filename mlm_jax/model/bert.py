"""BERT: the original post-LayerNorm encoder, with the MLM head (and optionally NSP/SOP).

The MLM head follows keras_nlp's MLMHead: gather the encoder output at the
masked positions only, then dense + GELU + LayerNorm and a projection tied to
the token embedding (plus a bias). No logits are computed for unmasked
positions. Shapes: see mlm_jax/model/config.py.
"""

from __future__ import annotations

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp

from mlm_jax.model import attention
from mlm_jax.model.config import Array
from mlm_jax.model.config import ModelConfig
from mlm_jax.model.encoder import EncoderInputs
from mlm_jax.model.encoder import run_blocks
from mlm_jax.model.heads import MLMHead
from mlm_jax.model.heads import SentencePairHead
from mlm_jax.model.layers import EMBED
from mlm_jax.model.layers import MLP
from mlm_jax.model.layers import TABLE
from mlm_jax.model.layers import VOCAB
from mlm_jax.model.layers import SelfAttention
from mlm_jax.model.layers import batch_split
from mlm_jax.model.layers import dense_init
from mlm_jax.model.layers import layer_norm
from mlm_jax.model.layers import take_rows
from mlm_jax.model.layers import zeros
from mlm_jax.runtime import platform_ops


class Embeddings(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, input_ids: Array, segment_ids: Array, positions: Array | None,
               deterministic: bool) -> Array:
    """input_ids, segment_ids, positions: [B, T] -> [B, T, d].

    positions=None means 0..T-1 in every row: the first T rows of the table,
    broadcast: the same values as gathering them, without a gather over
    [B, T] indices (nor the scatter-add of its gradient).
    """
    cfg = self.cfg
    token_table = nn.Embed(cfg.padded_vocab_size, cfg.hidden_size,
                           embedding_init=dense_init(cfg, (VOCAB, EMBED)), name='token')
    x = token_table(input_ids)
    position_table = nn.Embed(cfg.max_position_embeddings, cfg.hidden_size,
                              embedding_init=dense_init(cfg, (TABLE, EMBED)), name='position')
    if positions is None:
      x += position_table.embedding[:input_ids.shape[1]].astype(x.dtype)
    else:
      x += position_table(positions)
    if cfg.type_vocab_size:  # 0: no token types (DistilBERT), no table to add.
      x += nn.Embed(cfg.type_vocab_size, cfg.hidden_size,
                    embedding_init=dense_init(cfg, (TABLE, EMBED)), name='segment')(segment_ids)
    x = layer_norm(cfg, 'layer_norm')(batch_split(x))
    return self.ops.dropout(cfg.dropout_rate)(x, deterministic=deterministic)


@flax.struct.dataclass
class BlockInputs:
  """What a BERT block reads besides x: what each token may see."""

  mask: attention.Mask


class TransformerBlock(nn.Module):
  """Post-LN block: x = LN(x + Attn(x)); x = LN(x + MLP(x))."""

  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, x: Array, inputs: BlockInputs, deterministic: bool,
               rows: Array | None = None) -> Array:
    """x [B, T, d] -> [B, T, d]; with rows [B, Q] only those rows' outputs, [B, Q, d].

    Each row's output depends on the others only through attention's keys
    and values: the rows' queries attend to all T tokens, and the rest of
    the block runs on the Q rows alone.
    """
    cfg, ops = self.cfg, self.ops
    dense = lambda features, names, name: ops.dense(
        features, dtype=cfg.dtype, kernel_init=dense_init(cfg, names),
        bias_init=zeros(names[-1:]), name=name)
    dropout = lambda h: ops.dropout(cfg.dropout_rate)(batch_split(h), deterministic=deterministic)
    context = x = batch_split(x)
    if rows is not None:
      x = batch_split(take_rows(x, rows))
    h = dropout(SelfAttention(cfg, ops, name='attention')(x, inputs.mask, deterministic, context,
                                                          rows))
    x = layer_norm(cfg, 'attention_layer_norm')(x + h)
    h = ops.gelu(batch_split(dense(cfg.intermediate_size, (EMBED, MLP), 'intermediate')(x)))
    h = dropout(dense(cfg.hidden_size, (MLP, EMBED), 'output')(h))          # h: [B, T, d_ff] above
    return batch_split(layer_norm(cfg, 'output_layer_norm')(x + h))


class Encoder(nn.Module):
  cfg: ModelConfig
  ops: platform_ops.Ops = platform_ops.DEFAULT

  @nn.compact
  def __call__(self, inputs: EncoderInputs, deterministic: bool = True,
               return_all_layers: bool = False, output_rows: Array | None = None) -> Array:
    """inputs' [B, T] ids -> contextual embeddings [B, T, d].

    Reads input_ids, segment_ids, attention_mask, `positions` (each token's
    position embedding; None: 0..T-1) and `document_ids` (each token's
    document, which attention keeps it in; None: the row is one); BERT has
    no attention window, so no row_positions.
    With return_all_layers: [L + 1, B, T, d], the embeddings' output (index 0)
    and then every block's, the last being the usual output.
    `output_rows` [B, Q] (indices into T): only those rows' outputs, [B, Q, d]
    (encoder.run_blocks).
    """
    cfg = self.cfg
    x = Embeddings(cfg, self.ops, name='embeddings')(inputs.input_ids, inputs.segment_ids,
                                                    inputs.positions, deterministic)
    blocks = BlockInputs(attention.Mask(inputs.attention_mask.astype(bool),
                                        documents=inputs.document_ids))
    return run_blocks(cfg, TransformerBlock, x, deterministic, lambda layer: blocks, self.ops,
                      output_rows=output_rows, return_all_layers=return_all_layers)


def drop_tokens(batch: dict[str, Array], rate: float, rng: Array) -> dict[str, Array]:
  """DropToken: the encoder input without a fraction `rate` of the unmasked tokens.

  Each row keeps T' = T - round(rate * (T - P)) tokens, in their order and
  with their original positions: [CLS] and every masked slot are always
  kept, padding is dropped first, then random unmasked tokens. Returns the
  shortened input_ids/segment_ids/attention_mask/positions [B, T'] (and
  document_ids when the batch has them) and masked_positions re-indexed
  into the kept tokens.
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
  gather = lambda x: take_rows(x, kept)
  new_index = jnp.zeros((b, t), jnp.int32).at[rows, kept].set(jnp.arange(keep))
  out = {'input_ids': gather(batch['input_ids']), 'segment_ids': gather(batch['segment_ids']),
         'attention_mask': gather(batch['attention_mask']), 'positions': kept,
         'masked_positions': take_rows(new_index, batch['masked_positions'])}
  if 'document_ids' in batch:
    out['document_ids'] = gather(batch['document_ids'])
  return out


def document_positions(document_ids: Array) -> Array:
  """[B, T] document ids -> [B, T] positions counted from each document's first token.

  A document starts where the id changes (the row's first token starts one).
  """
  index = jnp.arange(document_ids.shape[1])[None]
  starts = jnp.concatenate([jnp.ones_like(document_ids[:, :1], bool),
                            document_ids[:, 1:] != document_ids[:, :-1]], axis=1)
  return index - jax.lax.cummax(jnp.where(starts, index, 0), axis=1)


class BertForMLM(nn.Module):
  """model.apply(params, batch) -> MLM logits [B, P, V] at the masked slots.

  `method=BertForMLM.pretrain` gives every training output (MLM logits, and
  the sentence-pair logits when the model has that head); for probing,
  `method=BertForMLM.all_layers` gives every layer's output and
  `method=BertForMLM.mlm_logits` runs the head on any one of them.
  """

  cfg: ModelConfig
  # The platform's dense, dropout and GELU (the builder's platform_ops.for_platform),
  # passed down to every module that uses them.
  ops: platform_ops.Ops = platform_ops.DEFAULT

  def setup(self):
    self.encoder = Encoder(self.cfg, self.ops)
    self.mlm_head = MLMHead(self.cfg, ops=self.ops)
    if self.cfg.sentence_pair_head:
      self.sentence_pair = SentencePairHead(self.cfg, self.ops)

  def __call__(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    return self.pretrain(batch, deterministic)['mlm_logits']

  def pretrain(self, batch: dict[str, Array], deterministic: bool = True) -> dict[str, Array]:
    """{'mlm_logits': [B, P, V]} (+ 'sentence_pair_logits': [B, 2] with that head)."""
    inputs = {k: batch[k] for k in ('input_ids', 'segment_ids', 'attention_mask',
                                    'masked_positions', 'document_ids') if k in batch}
    inputs['positions'] = self._positions(batch)
    row_positions = None
    if self.cfg.drop_token_rate > 0 and not deterministic and 'masked_weights' in batch:
      kept = drop_tokens(batch, self.cfg.drop_token_rate, self.make_rng('dropout'))
      row_positions = kept['positions']
      kept['positions'] = (row_positions if inputs['positions'] is None
                           else take_rows(inputs['positions'], row_positions))
      inputs = kept
    # The encoder's output is needed at the masked slots only (and at [CLS],
    # row 0, for the sentence-pair head): its last block computes those rows.
    rows = inputs['masked_positions']
    if self.cfg.sentence_pair_head:
      rows = jnp.concatenate([jnp.zeros_like(rows[:, :1]), rows], axis=1)
    sequence = self.encoder(
        EncoderInputs.of(inputs, positions=inputs['positions'], row_positions=row_positions,
                         document_ids=self._documents(inputs)),
        deterministic, output_rows=rows)
    if not self.cfg.sentence_pair_head:
      return {'mlm_logits': self.mlm_logits(sequence)}
    return {'mlm_logits': self.mlm_logits(sequence[:, 1:]),
            'sentence_pair_logits': self.sentence_pair(sequence, deterministic)}

  def all_layers(self, batch: dict[str, Array], deterministic: bool = True) -> Array:
    """[L + 1, B, T, d]: the embeddings' output, then each block's."""
    return self.encoder(EncoderInputs.of(batch, positions=self._positions(batch),
                                         document_ids=self._documents(batch)),
                        deterministic, return_all_layers=True)

  def _documents(self, batch: dict[str, Array]) -> Array | None:
    """The batch's document_ids [B, T] when attention keeps documents apart, else None.

    A batch without them (fine-tuning rows, a single text) is one document per row.
    """
    return batch.get('document_ids') if self.cfg.document_mask else None

  def _positions(self, batch: dict[str, Array]) -> Array | None:
    """[B, T] positions restarted at each document, or None (0..T-1 in every row)."""
    if not self.cfg.restart_positions or 'document_ids' not in batch:
      return None
    return document_positions(batch['document_ids'])

  def mlm_logits(self, sequence: Array, masked_positions: Array | None = None) -> Array:
    """sequence [B, T, d], masked_positions [B, P] -> logits [B, P, V] (tied embedding).

    Without masked_positions, sequence is already the encoder's output at
    the masked slots, [B, P, d].
    """
    # Boxed with its logical axis names while the model is being initialised.
    embedding = nn.unbox(self.encoder.variables['params']['embeddings']['token']['embedding'])
    return self.mlm_head(sequence, masked_positions, embedding)
