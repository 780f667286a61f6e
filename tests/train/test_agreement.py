"""The ranks' agreement on an error, `pipeline.train.state.agree_on_error`, with two ranks as processes:
one rank fails, every rank learns that rank's one line and ends with it, in the training step's
agreement and in fine-tuning's evaluation alike."""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import pytest
import torch

import vit
from pipeline.train.finetune import evaluate
from pipeline.train.state import StepAgreement, agree_on_error, agree_on_step
from tests.distributed import spawn

SHARD_ERROR = "shard s-000001.tar: truncated tar; remove it or write it again"


def _agreements(rank: int) -> None:
    # No rank failed: no message, the counts summed (ranks 0 and 1 hold 1 and 2).
    assert agree_on_error("", None, counts=(rank + 1, rank == 0)) == ("", [3.0, 1.0])
    # Rank 1 failed: both learn its message, the counts come all the same.
    mine = SHARD_ERROR if rank == 1 else ""
    assert agree_on_error(mine, None, counts=(rank + 1,)) == (SHARD_ERROR, [3.0])
    # Both failed: the lowest rank's message, on both.
    assert agree_on_error(f"rank {rank} failed", None) == ("rank 0 failed", [])
    # The step's agreement settles on it the same way.
    assert agree_on_step(4, False, mine, None) == StepAgreement(8, False, SHARD_ERROR)
    assert agree_on_step(4, rank == 1, "", None) == StepAgreement(8, True, "")
    # The epoch's tail: rank 1 has run dry, rank 0 still has samples, so the step runs; then neither has.
    tail = agree_on_step(3 if rank == 0 else 0, True, "", None)
    assert tail == StepAgreement(3, True, "") and tail.runs and not tail.epoch_over
    over = agree_on_step(0, True, "", None)
    assert over.epoch_over and not over.runs
    _evaluation(rank)


def _evaluation(rank: int) -> None:
    torch.manual_seed(0)
    model = vit.create_model("vit_tiny_test", num_classes=4).eval()
    c = model.config
    idle = (torch.zeros(1, c.num_patches, c.patch_dim, dtype=torch.uint8),)  # the model's inputs

    def batches() -> Iterator[dict[str, np.ndarray]]:
        yield {"patches": np.zeros((2, c.num_patches, c.patch_dim), np.uint8), "label": np.zeros(2, np.int64)}
        if rank == 1:
            raise ValueError(SHARD_ERROR)

    with pytest.raises(RuntimeError) as raised:
        evaluate(model, batches(), idle, torch.device("cpu"))
    assert str(raised.value) == f"evaluation data: ValueError: {SHARD_ERROR}"  # the same on both ranks
    assert "\n" not in str(raised.value)


def test_one_ranks_error_is_every_ranks_in_the_step_and_in_evaluation():
    spawn(_agreements)  # one spawn for both: starting two ranks costs more than what they run
