"""The linear probe: multinomial logistic regression (scikit-learn, L-BFGS, L2 penalty) on features
standardized with the training set's mean and std, as one linear map of the raw features.

Two rooms fit it: `pipeline.evaluate` scores embeddings with it, and `pipeline.train` starts a fine-tuning
head from it (``--head-init probe``). Folding the standardization into the weights makes the probe a
``Linear(D, K)``: ``logits = x @ weight.T + bias`` are scikit-learn's decision function on the same rows.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class LinearProbe:
    """A fitted probe: ``classes`` ``(K,)`` sorted labels, ``weight`` ``(K, D)`` and ``bias`` ``(K,)``
    over the raw features (float64), and whether L-BFGS converged."""

    classes: np.ndarray
    weight: np.ndarray
    bias: np.ndarray
    converged: bool

    def logits(self, x: np.ndarray) -> np.ndarray:
        """Features ``(n, D)`` -> logits ``(n, K)``, one column per class of ``classes``."""
        return np.asarray(x, dtype=np.float64) @ self.weight.T + self.bias

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self.classes[np.argmax(self.logits(x), axis=1)]


def fit_linear_probe(x: np.ndarray, y: np.ndarray, *, c: float = 1.0, max_iter: int = 1000) -> LinearProbe:
    """Logistic regression with inverse L2 strength ``c`` on ``x`` ``(n, D)``, labels ``y`` ``(n,)``.

    Raises ValueError when ``y`` holds fewer than two classes (there is nothing to separate)."""
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.preprocessing import StandardScaler

    if len(np.unique(y)) < 2:
        raise ValueError(f"a linear probe needs two classes or more; the {len(y)} rows hold one")
    scaler = StandardScaler().fit(x)
    probe = LogisticRegression(C=c, max_iter=max_iter)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ConvergenceWarning)
        probe.fit(scaler.transform(x), y)
    converged = not any(issubclass(w.category, ConvergenceWarning) for w in caught)
    coef, intercept = probe.coef_.astype(np.float64), probe.intercept_.astype(np.float64)
    if len(probe.classes_) == 2:
        # One decision column (class 1 against class 0): as two logits whose difference it is, the
        # softmax over them is the probe's sigmoid.
        coef, intercept = np.concatenate([-coef, coef]) / 2, np.concatenate([-intercept, intercept]) / 2
    # (x - mean) / scale @ coef.T + intercept, with the standardization folded in (a constant feature
    # has scale 1 in scikit-learn, so nothing divides by zero).
    weight = coef / scaler.scale_
    bias = intercept - weight @ scaler.mean_
    return LinearProbe(classes=probe.classes_, weight=weight, bias=bias, converged=converged)
