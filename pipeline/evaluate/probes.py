"""Scores of a representation: a linear probe, k-NN, and the paper's few-shot linear regression.

All three take features ``(n, D)`` float and integer labels ``(n,)`` and return accuracies in [0, 1]:

- `linear_probe_accuracy`: the linear probe of `pipeline.linear_probe` (multinomial logistic
  regression, scikit-learn, L-BFGS, L2 penalty, on features standardized with the training set's mean
  and std), the one that ``jobs/finetune.py --head-init probe`` starts its head from.
- `knn_accuracy`: the ``k`` training rows of highest cosine similarity vote, one vote each (majority);
  a tie goes to the smallest class index (scikit-learn's rule), so the result is deterministic.
- `few_shot_accuracy`: as in the paper (Dosovitskiy et al. 2021, section 4.1), a closed-form
  regularized least-squares fit of ``shots`` images per class onto {-1, 1} one-vs-rest targets, scored
  by the arg-max of its outputs, averaged over ``seeds`` draws of the shots. The features are
  centered on the drawn images' mean, so the intercept (the targets' mean) is not penalized.
"""

from __future__ import annotations

import numpy as np

from pipeline.linear_probe import fit_linear_probe


def linear_probe_accuracy(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    *,
    c: float = 1.0,
    max_iter: int = 1000,
) -> tuple[float, bool]:
    """``(accuracy, converged)`` of logistic regression with inverse L2 strength ``c``."""
    probe = fit_linear_probe(train_x, train_y, c=c, max_iter=max_iter)
    return float(np.mean(probe.predict(test_x) == test_y)), probe.converged


def knn_accuracy(
    train_x: np.ndarray, train_y: np.ndarray, test_x: np.ndarray, test_y: np.ndarray, *, k: int = 20
) -> float:
    """Accuracy of a majority vote among the ``k`` most cosine-similar training rows."""
    from sklearn.neighbors import KNeighborsClassifier

    if k > len(train_y):
        raise ValueError(f"--k {k} is more than the {len(train_y)} training rows; pass a smaller --k")
    knn = KNeighborsClassifier(n_neighbors=k, metric="cosine", algorithm="brute", weights="uniform")
    knn.fit(train_x, train_y)
    return float(np.mean(knn.predict(test_x) == test_y))


def ridge_fit(x: np.ndarray, y: np.ndarray, num_classes: int, l2_reg: float) -> tuple[np.ndarray, np.ndarray]:
    """Least squares onto {-1, 1} targets: ``x`` ``(n, D)``, ``y`` class indices ``(n,)`` in
    ``[0, num_classes)`` -> weights ``(D, K)`` and intercept ``(K,)`` minimizing
    ``|x W + b - T|^2 + l2_reg |W|^2`` with ``T[i, y[i]] = 1`` and -1 elsewhere."""
    x = np.asarray(x, dtype=np.float64)
    targets = np.full((len(y), num_classes), -1.0)
    targets[np.arange(len(y)), y] = 1.0
    x_mean, t_mean = x.mean(axis=0), targets.mean(axis=0)
    xc, tc = x - x_mean, targets - t_mean  # (n, D), (n, K)
    n, d = xc.shape
    if l2_reg == 0:
        w = np.linalg.lstsq(xc, tc, rcond=None)[0]  # the minimum-norm solution
    elif n <= d:
        # The same W from the n x n system (W = X^T (X X^T + l I)^-1 T): few shots, wide features.
        w = xc.T @ np.linalg.solve(xc @ xc.T + l2_reg * np.eye(n), tc)
    else:
        w = np.linalg.solve(xc.T @ xc + l2_reg * np.eye(d), xc.T @ tc)
    return w, t_mean - x_mean @ w


def ridge_accuracy(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    *,
    classes: np.ndarray,
    l2_reg: float,
) -> float:
    """Accuracy of `ridge_fit` on ``train``, predicting the arg-max output; ``classes`` (sorted) are
    the labels the outputs stand for."""
    index = np.searchsorted(classes, train_y)
    w, b = ridge_fit(train_x, index, len(classes), l2_reg)
    predicted = classes[np.argmax(np.asarray(test_x, dtype=np.float64) @ w + b, axis=1)]
    return float(np.mean(predicted == test_y))


def draw_shots(labels: np.ndarray, shots: int, seed: int) -> np.ndarray:
    """Indices of ``shots`` rows of every class, drawn without replacement, a function of (seed, shots)."""
    rng = np.random.default_rng([seed, shots])
    picked = [rng.choice(np.flatnonzero(labels == c), shots, replace=False) for c in np.unique(labels)]
    return np.sort(np.concatenate(picked))


def few_shot_accuracy(
    train_x: np.ndarray,
    train_y: np.ndarray,
    test_x: np.ndarray,
    test_y: np.ndarray,
    *,
    shots: int,
    seeds: int,
    l2_reg: float,
) -> list[float]:
    """Accuracy of `ridge_accuracy` on ``shots`` images per class, one per seed ``0 .. seeds-1``.

    Raises ValueError when a class has fewer than ``shots`` training rows."""
    classes, counts = np.unique(train_y, return_counts=True)
    if counts.min() < shots:
        rare = classes[np.argmin(counts)]
        raise ValueError(f"class {rare} has {counts.min()} training rows, fewer than {shots} shots")
    scores = []
    for seed in range(seeds):
        idx = draw_shots(train_y, shots, seed)
        scores.append(
            ridge_accuracy(train_x[idx], train_y[idx], test_x, test_y, classes=classes, l2_reg=l2_reg)
        )
    return scores
