"""Bad-sample accounting: filtering, the budget rule, unlabeled shards, merging across workers."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples, LabelsMissingError


def batch(errors: list[str]) -> dict[str, np.ndarray]:
    n = len(errors)
    return {
        "key": np.array([f"k{i}" for i in range(n)], dtype=object),
        "url": np.array(["s3://b/train-000000.tar"] * n, dtype=object),
        "patches": np.arange(n, dtype=np.uint8).reshape(n, 1, 1),
        "label": np.arange(n, dtype=np.int64),
        "error": np.array(errors, dtype=object),
    }


def test_filter_removes_error_rows_and_records_them():
    bad = BadSamples()
    out = bad.filter(batch(["", "truncated image: cut", "", "missing image: none"]))
    assert list(out["key"]) == ["k0", "k2"] and list(out["label"]) == [0, 2]
    assert out["patches"].shape == (2, 1, 1)
    assert (bad.total, bad.bad) == (4, 2)
    assert bad.by_reason == {"truncated image": 1, "missing image": 1}
    assert bad.examples[0] == {
        "url": "s3://b/train-000000.tar",
        "key": "k1",
        "reason": "truncated image: cut",
    }
    clean = batch(["", ""])
    assert bad.filter(clean) is clean  # nothing to drop: no copy


def test_one_bad_sample_in_the_first_batch_does_not_fail_the_job():
    bad = BadSamples(max_bad_fraction=0.01, grace_samples=1000)
    bad.filter(batch(["undecodable image: x"] + [""] * 7))
    bad.check_budget()  # 1 of 8 is 12.5%, but within the grace allowance of 10 bad samples


def test_budget_fails_past_the_grace_allowance_and_then_on_the_share():
    bad = BadSamples(max_bad_fraction=0.01, grace_samples=1000)
    bad.filter(batch(["undecodable image: x"] * 10 + [""] * 10))
    bad.check_budget()  # 10 bad <= 0.01 * 1000
    bad.filter(batch(["truncated image: y"]))
    with pytest.raises(BadSampleBudgetError) as info:
        bad.check_budget()
    message = str(info.value)
    assert "11 of 21 samples are bad" in message and "max_bad_fraction" in message and "\n" not in message
    big = BadSamples(max_bad_fraction=0.01, grace_samples=1000)
    big.filter(batch([""] * 3000))
    big.filter(batch(["x: y"] * 30))
    big.check_budget()  # 30 of 3030 < 1%
    big.filter(batch(["x: y"]))
    with pytest.raises(BadSampleBudgetError):
        big.check_budget()


def test_the_final_check_judges_a_small_dataset_by_its_real_share():
    bad = BadSamples(max_bad_fraction=0.1, grace_samples=1000)
    bad.filter(batch(["x: y"] * 3 + [""] * 17))
    bad.check_budget()
    with pytest.raises(BadSampleBudgetError, match=r"15\.0%"):
        bad.check_budget(final=True)


def test_zero_budget_fails_on_the_first_bad_sample():
    bad = BadSamples(max_bad_fraction=0.0)
    bad.filter(batch([""] * 5))
    bad.check_budget(final=True)
    bad.filter(batch(["x: y"]))
    with pytest.raises(BadSampleBudgetError):
        bad.check_budget()


def test_unlabeled_shards_fail_with_their_own_message():
    bad = BadSamples()
    bad.filter(batch(["missing label: no .cls member (label_key='cls')"] * 8))
    bad.check_budget()  # 8 samples are not yet proof
    bad.filter(batch(["missing label: no .cls member (label_key='cls')"] * 8))
    with pytest.raises(LabelsMissingError, match="look unlabeled"):
        bad.check_budget()
    few = BadSamples()
    few.filter(batch(["missing label: no .cls member"] * 3))
    with pytest.raises(LabelsMissingError):
        few.check_budget(final=True)


def test_counts_merge_across_workers_and_round_trip_through_dicts():
    a, b = BadSamples(max_examples=3), BadSamples()
    a.filter(batch(["x: 1", "", "y: 2"]))
    b.filter(batch(["x: 3", "x: 4", ""]))
    merged = BadSamples(max_examples=3).merge(a).merge(b.to_dict())
    assert (merged.total, merged.bad) == (6, 4)
    assert merged.by_reason == {"x": 3, "y": 1}
    assert len(merged.examples) == 3
    again = BadSamples.from_dict(merged.to_dict())
    assert again.to_dict() == {**merged.to_dict(), "max_bad_fraction": 0.01, "grace_samples": 1000}


# --- lost shards ---------------------------------------------------------------------------------
def lost(url: str, why: str = "the tar holds no samples") -> dict[str, np.ndarray]:
    rows = batch([f"lost shard: {why}"])
    rows["url"] = np.array([url], dtype=object)
    rows["key"] = np.array([""], dtype=object)
    return rows


def test_a_lost_shard_is_counted_apart_from_bad_samples_once_per_shard():
    bad = BadSamples(max_lost_shards=2)
    out = bad.filter(lost("a.tar"))
    assert len(out["key"]) == 0 and (bad.total, bad.bad) == (0, 0) and bad.by_reason == {}
    bad.filter(lost("a.tar"))  # read again in the next epoch: still one lost shard
    bad.filter(lost("b.tar", "1 row(s), none readable, first: corrupt tar: not a tar"))
    assert bad.lost == {
        "a.tar": "the tar holds no samples",
        "b.tar": "1 row(s), none readable, first: corrupt tar: not a tar",
    }
    bad.check_budget(final=True)  # 2 allowed
    again = BadSamples.from_dict(bad.to_dict())
    assert again.lost == bad.lost and again.max_lost_shards == 2
    merged = BadSamples().merge(bad).merge(BadSamples.from_dict(bad.to_dict()))  # two ranks, same shards
    assert len(merged.lost) == 2


def test_lost_shards_past_their_budget_fail_in_one_line_naming_them():
    bad = BadSamples()  # none allowed by default
    for i in range(5):
        bad.filter(lost(f"s3://b/train-{i:06d}.tar"))
    with pytest.raises(BadSampleBudgetError) as info:
        bad.check_budget()
    message = str(info.value)
    assert message.startswith(
        "5 shard(s) gave no readable sample (max_lost_shards 0): s3://b/train-000000.tar"
    )
    assert (
        message.endswith("and 2 more; replace or remove them, or raise max_lost_shards")
        and "\n" not in message
    )


def test_bad_samples_counted_while_tagged_carry_the_tag_in_counted():
    """A mixed run's reader tags what its pass counts with (source, pass); counts outside carry no tag."""
    indexed = {
        **batch(["", "truncated image: cut"]),
        "index": np.array([0, 1]),
        "shard_size": np.array([-1, 2]),
    }
    url = "s3://b/train-000000.tar"
    counts = BadSamples()
    counts.filter(indexed)
    with counts.tagged(1, 2):
        counts.filter(indexed)
        with counts.tagged(0, 5):
            counts.filter(indexed)
        counts.filter(indexed)
    counts.filter(indexed)
    assert counts.take_counted() == [
        (url, 1, 2), (url, 1, 2, 1, 2), (url, 1, 2, 0, 5), (url, 1, 2, 1, 2), (url, 1, 2),
    ]  # fmt: skip
    assert counts.tag == () and counts.counted == []
