"""The benchmark's peer (`--compare=hf`): Hugging Face's model of the same architecture.

interop/torch_mlm.py's model: the same shape (layers, widths, padded
vocabulary), batches, masked positions and optimizer (AdamW, same
hyper-parameters, clipping and weight-decay mask) as our step: float32 on CPU;
on a GPU bf16 autocast (when our compute dtype is bf16) and SDPA attention.
Eager or under `torch.compile` (the caller decides; on CPU its inductor
backend needs a C++ compiler).
"""

from __future__ import annotations

import dataclasses
import os
import resource
import shutil
import sys
import time
from typing import Any

import ml_collections
import numpy as np

from mlm_jax.interop import hf as hf_lib
from mlm_jax.interop import torch_mlm


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
  """Hugging Face's masked LM + torch AdamW on the same shapes, batches and masks."""

  def __init__(self, config: ml_collections.ConfigDict, model_cfg, host_batches,
               lr_per_step: np.ndarray, use_gpu: bool, compiled: bool):
    if compiled and not use_gpu and cxx_compiler() is None:
      # Inductor would fail only at the first step, with a long traceback.
      raise RuntimeError(f'no C++ compiler for torch.compile on CPU (tried '
                         f'{", ".join(_cxx_names())} on PATH; set $CXX)')
    self._mlm = torch_mlm.TorchMLM(config, model_cfg, use_gpu=use_gpu, compiled=compiled)
    self._torch = hf_lib.require('torch')
    self._device = self._mlm.device
    self.timed = Timed(f'HF {self._mlm.name} ({"torch.compile" if compiled else "torch eager"})')
    self._lrs = lr_per_step
    self._batches = [self._mlm.inputs(b) for b in host_batches]
    self._i = 0
    self._loss = None
    self.timed.info.update(
        **self._mlm.info,
        masked_tokens_per_step=float(np.mean([int((b['labels'] != -100).sum())
                                              for b in self._batches])))

  def step(self) -> None:
    lr = float(self._lrs[min(self._i, len(self._lrs) - 1)])
    self._loss = self._mlm.train_step(self._batches[self._i % len(self._batches)], lr)
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
