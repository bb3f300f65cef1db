"""Hugging Face's masked LM of a config, in PyTorch, trained the way our step trains.

The config's variant picks the model (`BertForMaskedLM` for 'bert',
`RobertaForMaskedLM` for 'roberta', `ModernBertForMaskedLM` for 'modern'),
built from our shape with the padded vocabulary and the special ids of the
run's tokenizer (RoBERTa numbers positions from its pad id), so both project
onto the same V rows and read the same positions, and initialised by
transformers' own rules. Our batches become its inputs (labels -100 except at
our masked slots), and torch AdamW gets our hyper-parameters, clipping and
weight-decay mask (matrices decay; biases and norms do not), with the
learning rate the caller gives each step. Its loss is the mean cross-entropy
over the batch's masked tokens: ours, sum / |M|, on one process.

The benchmark's peer (perf/hf_peer.py) times it; the side-by-side
(analysis/side_by_side.py) trains and evaluates it.
"""

from __future__ import annotations

from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from mlm_jax import model as model_lib
from mlm_jax.data import sp_tokenizer
from mlm_jax.data import tokenizer as tok_lib
from mlm_jax.interop import hf as hf_lib
from mlm_jax.runtime import cores


def hf_model_name(variant: str) -> str:
  """'BertForMaskedLM', 'RobertaForMaskedLM' or 'ModernBertForMaskedLM'."""
  return hf_lib.FORMATS[variant].architecture


class TorchMLM:
  """One Hugging Face masked LM and its optimizer, stepped on our batches."""

  def __init__(self, config: ml_collections.ConfigDict, model_cfg: model_lib.ModelConfig, *,
               specials: tok_lib.Specials = sp_tokenizer.SPECIALS, use_gpu: bool = False,
               compiled: bool = False):
    """`specials`: the ids of the run's tokenizer (default: the layout of the tokenizers
    trained here, ids 0-4)."""
    torch = hf_lib.require('torch')
    transformers = hf_lib.require('transformers')
    self._torch = torch
    torch.set_num_threads(cores.usable_cores())
    torch.manual_seed(config.seed)
    self.device = torch.device('cuda' if use_gpu else 'cpu')
    self.bf16 = jnp.dtype(model_cfg.dtype) == jnp.bfloat16
    if use_gpu:
      # JAX's default float32 matmul precision on GPUs uses TF32; let torch do the same.
      torch.set_float32_matmul_precision('high')
    fmt = hf_lib.model_format(model_cfg)  # DistilBERT for a BERT without token types.
    fields = {**fmt.to_config(model_cfg, specials), 'vocab_size': model_cfg.padded_vocab_size}
    fields.pop('architectures')
    if model_cfg.variant == 'modern':
      # Its head and decoder run on the masked tokens only, as our gather head does.
      fields['sparse_prediction'] = True
    hf_config = transformers.AutoConfig.for_model(**fields, attn_implementation='sdpa')
    self.name, self.variant = fmt.architecture, model_cfg.variant
    self._input_names = fmt.input_names
    model = getattr(transformers, fmt.architecture)(hf_config).to(self.device).train()
    params = list(model.parameters())
    groups = [{'params': [p for p in params if p.ndim >= 2]},
              {'params': [p for p in params if p.ndim < 2], 'weight_decay': 0.0}]
    tr = config.train
    self._opt = torch.optim.AdamW(groups, lr=tr.learning_rate, betas=(tr.adam_b1, tr.adam_b2),
                                  eps=tr.adam_eps, weight_decay=tr.weight_decay, fused=use_gpu)
    self._params = params
    self._clip = tr.grad_clip_norm
    self.eager_model = model
    # Lazy: torch.compile compiles (and may fail) at the first step.
    self.model = torch.compile(model) if compiled else model
    self.info = {'device': str(self.device), 'attn_implementation': hf_config._attn_implementation,
                 'autocast_bf16': self.bf16, 'torch_compile': compiled, 'fused_adamw': use_gpu,
                 'num_params': sum(p.numel() for p in params)}

  def inputs(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Our batch -> the model's inputs [B, T]; labels are -100 except at our masked slots."""
    labels = np.full(batch['input_ids'].shape, -100, np.int64)
    rows, slots = np.nonzero(batch['masked_weights'] > 0)
    labels[rows, batch['masked_positions'][rows, slots]] = batch['masked_ids'][rows, slots]
    t = lambda x: self._torch.from_numpy(np.asarray(x, np.int64)).to(self.device)
    ours = {'input_ids': 'input_ids', 'attention_mask': 'attention_mask',
            'token_type_ids': 'segment_ids'}
    return {**{name: t(batch[ours[name]]) for name in self._input_names}, 'labels': t(labels)}

  def train_step(self, inputs: dict[str, Any], learning_rate: float):
    """One optimizer step; returns the loss (a tensor, not synchronised)."""
    torch = self._torch
    for group in self._opt.param_groups:
      group['lr'] = learning_rate
    self._opt.zero_grad(set_to_none=True)
    with torch.autocast(self.device.type, dtype=torch.bfloat16, enabled=self.bf16):
      loss = self.model(**inputs).loss
    loss.backward()
    if self._clip > 0:
      torch.nn.utils.clip_grad_norm_(self._params, self._clip)
    self._opt.step()
    return loss.detach()

  def save_pretrained(self, out_dir: str, tokenizer: tok_lib.Tokenizer,
                      model_max_length: int) -> None:
    """The model as the hub holds one: `save_pretrained` (config.json, model.safetensors) and
    the tokenizer's files, which AutoModelForMaskedLM, AutoTokenizer and config.init.hf_dir read.

    Its vocabulary is our padded one (rows past the tokenizer's are never predicted).
    """
    model = self.eager_model
    if getattr(model.config, 'sparse_prediction', False):
      model.config.sparse_prediction = False  # A training shortcut, not part of the model.
    model.save_pretrained(out_dir)
    hf_lib.save_tokenizer(out_dir, tokenizer, model_max_length, variant=self.variant)

  def predict(self, batch: dict[str, np.ndarray]
              ) -> tuple[tuple[np.ndarray, np.ndarray], np.ndarray, np.ndarray]:
    """((rows, positions), argmax, per-token loss) of the batch's masked tokens, row-major.

    The eager model in eval mode (no dropout), without gradients.
    """
    torch = self._torch
    inputs = self.inputs(batch)
    selected = inputs['labels'] != -100
    self.eager_model.eval()
    try:
      with torch.no_grad(), torch.autocast(self.device.type, dtype=torch.bfloat16,
                                           enabled=self.bf16):
        logits = self.eager_model(**inputs).logits.float()
    finally:
      self.eager_model.train()
    if logits.dim() == 3:  # Every position (BERT); a sparse head gives the masked ones only.
      logits = logits[selected]
    loss = torch.nn.functional.cross_entropy(logits, inputs['labels'][selected], reduction='none')
    rows, positions = (x.cpu().numpy() for x in selected.nonzero(as_tuple=True))
    return (rows, positions), logits.argmax(-1).cpu().numpy(), loss.cpu().numpy()
