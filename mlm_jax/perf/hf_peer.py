"""Hugging Face's BertForMaskedLM in PyTorch as the benchmark's peer (`--compare=hf`).

The same model shape (layers, widths, padded vocabulary), batches, masked
positions and optimizer (AdamW, same hyper-parameters, clipping and
weight-decay mask) as our step: float32 on CPU; on a GPU bf16 autocast (when
our compute dtype is bf16) and SDPA attention. Eager or under `torch.compile`
(the caller decides; on CPU its inductor backend needs a C++ compiler).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import sys
import time
from typing import Any

import jax.numpy as jnp
import ml_collections
import numpy as np

from mlm_jax.interop import hf as hf_lib


@dataclasses.dataclass
class Timed:
  """One system's measurements: seconds per step of each window, and the rest."""

  name: str
  window_step_s: list[float] = dataclasses.field(default_factory=list)
  info: dict[str, Any] = dataclasses.field(default_factory=dict)


def host_peak_rss() -> int:
  rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
  return rss if sys.platform == 'darwin' else rss * 1024  # Linux reports KiB.


def _cxx_names() -> list[str]:
  # Inductor tries the names in its config ($CXX, else g++; clang++ on macOS), no others.
  try:
    names = hf_lib.require('torch._inductor.config').cpp.cxx
  except (ImportError, AttributeError):  # A private module of torch: it may move.
    names = (os.environ.get('CXX', 'g++'),)
  return [n for n in names if n]


def cxx_compiler() -> str | None:
  """The C++ compiler torch.compile would build CPU kernels with, if it is on PATH."""
  return next((path for path in map(shutil.which, _cxx_names()) if path), None)


class TorchRunner:
  """Hugging Face BertForMaskedLM + torch AdamW on the same shapes, batches and masks."""

  def __init__(self, config: ml_collections.ConfigDict, model_cfg, host_batches,
               lr_per_step: np.ndarray, use_gpu: bool, compiled: bool):
    torch = hf_lib.require('torch')
    transformers = hf_lib.require('transformers')
    if compiled and not use_gpu and cxx_compiler() is None:
      # Inductor would fail only at the first step, with a long traceback.
      raise RuntimeError(f'no C++ compiler for torch.compile on CPU (tried '
                         f'{", ".join(_cxx_names())} on PATH; set $CXX)')
    self._torch = torch
    self.timed = Timed(f'HF BertForMaskedLM ({"torch.compile" if compiled else "torch eager"})')
    torch.set_num_threads(os.cpu_count() or 1)
    torch.manual_seed(config.seed)
    self._device = torch.device('cuda' if use_gpu else 'cpu')
    self._bf16 = jnp.dtype(model_cfg.dtype) == jnp.bfloat16
    if use_gpu:
      # JAX's default float32 matmul precision on GPUs uses TF32; let torch do the same.
      torch.set_float32_matmul_precision('high')
    # The padded vocabulary, so both models project onto the same V rows.
    hf_config = transformers.BertConfig(
        **{**hf_lib.to_hf_config(model_cfg), 'vocab_size': model_cfg.padded_vocab_size},
        attn_implementation='sdpa')
    model = transformers.BertForMaskedLM(hf_config).to(self._device).train()
    # Our weight-decay mask: matrices (kernels, embeddings) decay; biases and LayerNorm do not.
    params = list(model.parameters())
    groups = [{'params': [p for p in params if p.ndim >= 2]},
              {'params': [p for p in params if p.ndim < 2], 'weight_decay': 0.0}]
    tr = config.train
    self._opt = torch.optim.AdamW(groups, lr=float(lr_per_step[0]), betas=(tr.adam_b1, tr.adam_b2),
                                  eps=tr.adam_eps, weight_decay=tr.weight_decay, fused=use_gpu)
    self._params = params
    self._clip = tr.grad_clip_norm
    self._lrs = lr_per_step
    # Lazy: torch.compile compiles (and may fail) at the first step.
    self._model = torch.compile(model) if compiled else model
    self._batches = [self._to_torch(b) for b in host_batches]
    self._i = 0
    self._loss = None
    self.timed.info.update(
        device=str(self._device), attn_implementation=hf_config._attn_implementation,
        autocast_bf16=self._bf16, torch_compile=compiled, fused_adamw=use_gpu,
        num_params=sum(p.numel() for p in params),
        masked_tokens_per_step=float(np.mean([int((b['labels'] != -100).sum())
                                              for b in self._batches])))

  def _to_torch(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Our batch -> HF inputs [B, T]; labels are -100 except at the same masked slots."""
    labels = np.full(batch['input_ids'].shape, -100, np.int64)
    rows, slots = np.nonzero(batch['masked_weights'] > 0)
    labels[rows, batch['masked_positions'][rows, slots]] = batch['masked_ids'][rows, slots]
    t = lambda x: self._torch.from_numpy(np.asarray(x, np.int64)).to(self._device)
    return {'input_ids': t(batch['input_ids']), 'attention_mask': t(batch['attention_mask']),
            'token_type_ids': t(batch['segment_ids']), 'labels': t(labels)}

  def step(self) -> None:
    torch = self._torch
    for group in self._opt.param_groups:
      group['lr'] = float(self._lrs[min(self._i, len(self._lrs) - 1)])
    self._opt.zero_grad(set_to_none=True)
    with torch.autocast(self._device.type, dtype=torch.bfloat16, enabled=self._bf16):
      loss = self._model(**self._batches[self._i % len(self._batches)]).loss
    loss.backward()
    if self._clip > 0:
      torch.nn.utils.clip_grad_norm_(self._params, self._clip)
    self._opt.step()
    self._loss = loss.detach()
    self._i += 1

  def run(self, steps: int) -> float:
    start = time.perf_counter()
    for _ in range(steps):
      self.step()
    if self._device.type == 'cuda':
      self._torch.cuda.synchronize()
    return time.perf_counter() - start

  def finish(self) -> None:
    torch = self._torch
    info = self.timed.info
    info['final_loss'] = float(self._loss)
    if self._device.type == 'cuda':
      info.update(peak_memory_bytes=int(torch.cuda.max_memory_allocated()),
                  memory_kind='device (torch.cuda.max_memory_allocated)')
    else:
      info.update(peak_memory_bytes=host_peak_rss(),
                  memory_kind='host peak RSS of the whole process (all systems)')
