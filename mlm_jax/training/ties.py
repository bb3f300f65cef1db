"""TIES merging (Yadav et al., 2023, "TIES-Merging: Resolving Interference When Merging
Models", arXiv 2306.01708): branches trained from one base checkpoint merged into one model.

With θ_0 the base and θ_1..θ_n the branches (same parameter tree), each branch's task
vector τ_t = θ_t - θ_0 over the whole model (every parameter flattened into one vector):

  1. trim:  τ̂_t keeps the int(k·d) entries of τ_t largest in magnitude (d entries in all;
            at least one; all where k = 1), the rest set to 0; every entry tied with the
            smallest kept magnitude is kept too;
  2. elect: γ = sign(Σ_t τ̂_t), entry by entry;
  3. disjoint mean: τ_m = the mean of the τ̂_t whose sign is γ, over those t only (0 where
            none is, or where γ = 0);
  4. θ = θ_0 + λ·τ_m.

k is the paper's density (`density`, 0.2 there), λ its scaling (`scale`, 1 there). The trim
is over each whole task vector, as in the paper and its code (mergekit trims tensor by
tensor). Where the trimmed values of an entry sum to exactly 0 the paper's γ is 0 and so is
the merge; the authors' code then elects the sign of the majority of all entries instead.

What must stay true: the arithmetic is float32, per tensor, the branches summed in the order
given; the result has the base's tree and float32 leaves. A test holds it to a
straightforward numpy reference on random trees.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

Params = Any


def thresholds(base: Params, branches: Sequence[Params], density: float) -> list[float]:
  """[n] each branch's trim threshold: the int(density·d)-th largest |θ_t - θ_0| over all d
  entries of the model (0 where every entry is kept)."""
  base_leaves = [np.asarray(x, np.float32) for x in jax.tree_util.tree_leaves(base)]
  out = []
  for branch in branches:
    # One flat vector of magnitudes per branch: the trim is over the whole task vector.
    mags = np.concatenate([np.abs(np.asarray(b, np.float32) - a).ravel()
                           for a, b in zip(base_leaves, jax.tree_util.tree_leaves(branch))])
    d = mags.size
    keep = max(int(density * d), 1)
    out.append(0.0 if keep >= d else float(np.partition(mags, d - keep)[d - keep]))
  return out


def merge(base: Params, branches: Sequence[Params], density: float = 0.2,
          scale: float = 1.0) -> Params:
  """θ_0 + λ·τ_m (module docstring) for branches of one tree with the base; float32 leaves."""
  if not branches:
    raise ValueError('TIES merges one branch or more')
  if not 0.0 < density <= 1.0:
    raise ValueError(f'density={density} must be in (0, 1]')
  cuts = thresholds(base, branches, density)
  branch_leaves = [jax.tree_util.tree_leaves(b) for b in branches]

  def merge_leaf(i: int, theta0: Any) -> np.ndarray:
    theta0 = np.asarray(theta0, np.float32)
    # tau: [n, *shape], each branch's trimmed task vector for this tensor.
    tau = np.stack([np.asarray(leaves[i], np.float32) - theta0 for leaves in branch_leaves])
    cut = np.asarray(cuts, np.float32).reshape((-1,) + (1,) * theta0.ndim)
    tau = np.where(np.abs(tau) >= cut, tau, np.float32(0))
    elected = np.sign(tau.sum(axis=0))
    agree = (np.sign(tau) == elected) & (elected != 0)
    kept = np.where(agree, tau, np.float32(0))
    count = np.maximum(agree.sum(axis=0), 1).astype(np.float32)
    return theta0 + np.float32(scale) * (kept.sum(axis=0) / count)

  leaves, treedef = jax.tree_util.tree_flatten(base)
  return jax.tree_util.tree_unflatten(treedef, [merge_leaf(i, x) for i, x in enumerate(leaves)])
