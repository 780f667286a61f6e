"""Each score on tiny inputs whose answer is worked out by hand in the comments."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.evaluate import probes


def test_linear_probe_puts_the_boundary_between_symmetric_classes():
    # Symmetric around 0, so the fitted boundary is x = 0: -0.5 -> class 0 and 0.5 -> class 1,
    # which makes the last test label (1 at x = -0.5) the one miss: 3 of 4.
    train_x = np.array([[-2.0], [-1.0], [1.0], [2.0]])
    train_y = np.array([0, 0, 1, 1])
    test_x = np.array([[-3.0], [0.5], [3.0], [-0.5]])
    accuracy, converged = probes.linear_probe_accuracy(train_x, train_y, test_x, np.array([0, 1, 1, 1]))
    assert accuracy == 0.75 and converged


def test_knn_uses_cosine_similarity_not_distance():
    # (1, 0.5) is at angle 27 degrees from (10, 0) and 63 from (0, 1): cosine picks class 0, while
    # the Euclidean nearest row would be (0, 1) (distance 1.1 against 9.0), class 1.
    train_x = np.array([[10.0, 0.0], [0.0, 1.0]])
    train_y = np.array([0, 1])
    assert probes.knn_accuracy(train_x, train_y, np.array([[1.0, 0.5]]), np.array([0]), k=1) == 1.0


def test_knn_is_a_majority_vote_of_k():
    # Angles of the training rows: class 1 at 10 degrees, class 0 at 20 and 25, class 1 at 80 and 90.
    # A test row at 5 degrees: its nearest row is class 1 (k=1 says 1), but of its 3 nearest
    # (10, 20, 25 degrees) two are class 0, so k=3 says 0.
    angles = np.radians([10, 20, 25, 80, 90])
    train_x = np.stack([np.cos(angles), np.sin(angles)], axis=1)
    train_y = np.array([1, 0, 0, 1, 1])
    test_x = np.array([[np.cos(np.radians(5)), np.sin(np.radians(5))]])
    assert probes.knn_accuracy(train_x, train_y, test_x, np.array([1]), k=1) == 1.0
    assert probes.knn_accuracy(train_x, train_y, test_x, np.array([0]), k=3) == 1.0
    with pytest.raises(ValueError, match="--k 6 is more than the 5 training rows"):
        probes.knn_accuracy(train_x, train_y, test_x, np.array([0]), k=6)


def test_ridge_fit_matches_the_closed_form_by_hand():
    # x = [9, 11] -> centered [-1, 1]; targets [[1, -1], [-1, 1]] (mean 0). With l2 = 1:
    # W = (sum x_c^2 + 1)^-1 x_c^T T = (2 + 1)^-1 [-2, 2] = [-2/3, 2/3]; b = -10 W = [20/3, -20/3].
    w, b = probes.ridge_fit(np.array([[9.0], [11.0]]), np.array([0, 1]), 2, l2_reg=1.0)
    np.testing.assert_allclose(w, [[-2 / 3, 2 / 3]])
    np.testing.assert_allclose(b, [20 / 3, -20 / 3])
    # Without a penalty it interpolates the targets: W = [-1, 1].
    w, b = probes.ridge_fit(np.array([[9.0], [11.0]]), np.array([0, 1]), 2, l2_reg=0.0)
    np.testing.assert_allclose(w, [[-1.0, 1.0]])
    # The intercept is not penalized: the boundary stays at the midpoint, 10.
    accuracy = probes.ridge_accuracy(
        np.array([[9.0], [11.0]]),
        np.array([3, 7]),
        np.array([[9.9], [10.1]]),
        np.array([3, 7]),
        classes=np.array([3, 7]),
        l2_reg=100.0,
    )
    assert accuracy == 1.0


def test_ridge_fit_is_the_same_from_the_small_and_the_wide_system():
    # n <= D solves the n x n (dual) system, n > D the D x D one: both are the one minimizer.
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(12, 8)), np.arange(12) % 3
    w_primal, b_primal = probes.ridge_fit(x, y, 3, l2_reg=0.5)  # 12 > 8: primal
    wide = np.concatenate([x, np.zeros((12, 8))], axis=1)  # 12 <= 16: dual, extra columns all zero
    w_dual, b_dual = probes.ridge_fit(wide, y, 3, l2_reg=0.5)
    np.testing.assert_allclose(w_dual[:8], w_primal, atol=1e-10)
    np.testing.assert_allclose(w_dual[8:], 0, atol=1e-12)
    np.testing.assert_allclose(b_dual, b_primal, atol=1e-10)


def test_few_shot_averages_the_draws():
    # Class 0 has rows at -1 and -3, class 1 one row at +1. One shot each: the boundary is the
    # midpoint of the two drawn rows, 0 (drew -1) or -1 (drew -3). Test rows -1.5 and -0.5, both
    # class 0: a draw of -1 gets both (1.0), a draw of -3 misses -0.5 (0.5).
    train_x, train_y = np.array([[-1.0], [-3.0], [1.0]]), np.array([0, 0, 1])
    test_x, test_y = np.array([[-1.5], [-0.5]]), np.array([0, 0])
    scores = probes.few_shot_accuracy(train_x, train_y, test_x, test_y, shots=1, seeds=20, l2_reg=0.0)
    expected = [1.0 if -1.0 in train_x[probes.draw_shots(train_y, 1, s)] else 0.5 for s in range(20)]
    assert scores == expected and set(scores) == {0.5, 1.0}  # both draws happen in 20 seeds
    # Same seeds, same draws.
    assert probes.few_shot_accuracy(train_x, train_y, test_x, test_y, shots=1, seeds=20, l2_reg=0.0) == scores
    with pytest.raises(ValueError, match="class 1 has 1 training rows, fewer than 2 shots"):
        probes.few_shot_accuracy(train_x, train_y, test_x, test_y, shots=2, seeds=1, l2_reg=0.0)


def test_draw_shots_takes_that_many_of_every_class():
    labels = np.repeat([4, 5, 6], 10)
    idx = probes.draw_shots(labels, 3, seed=1)
    assert sorted(np.unique(labels[idx], return_counts=True)[1]) == [3, 3, 3]
    assert len(set(idx)) == 9
