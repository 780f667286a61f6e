"""Sources mixed by weight, without Ray or torch: the ``--data`` spec, the draw, the mixed stream."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.data.bad_samples import BadSampleBudgetError, BadSamples
from pipeline.data.mixture import (
    MixtureError,
    Source,
    SourceReader,
    check_disjoint,
    draw_sources,
    mixed_micro_batches,
    parse_sources,
    pass_epoch,
)


@pytest.mark.parametrize(
    "spec, sources",
    [
        (
            "laion=s3://a/{000..999}.tar:0.7,cc=s3://b/{00..99}.tar:0.3",
            [Source("laion", "s3://a/{000..999}.tar", 0.7), Source("cc", "s3://b/{00..99}.tar", 0.3)],
        ),
        # URLs of one source, comma-separated; a weight left out is 1; weights are relative.
        (
            "a=/x/a.tar,/x/b.tar:2,b=gs://y/{0..3}.tar",
            [Source("a", "/x/a.tar,/x/b.tar", 2.0), Source("b", "gs://y/{0..3}.tar")],
        ),
        ("only=/data/shards", [Source("only", "/data/shards")]),
    ],
)
def test_a_mixture_spec_gives_its_sources(spec, sources):
    assert parse_sources(spec) == sources


@pytest.mark.parametrize(
    "spec",
    ["/data/shards", "s3://b/train-{000..009}.tar,s3://b/extra.tar", "s3://b/date=2024/x.tar", "x.tar"],
)
def test_a_plain_data_spec_is_no_mixture(spec):
    assert parse_sources(spec) is None


@pytest.mark.parametrize(
    "spec, says",
    [
        ("a=/x:0,b=/y:1", "weight 0.0 must be a positive number"),
        ("a=/x:-1,b=/y:1", "weight -1.0 must be a positive number"),
        ("a=/x:nan", "weight nan must be a positive number"),
        ("a=/x:inf", "weight inf must be a positive number"),
        ("a=/x:heavy", "weight 'heavy' is not a number"),
        ("a=/x:", "weight '' is not a number"),
        ("a=:0.5,b=/y", "source a names no shards"),
        ("/x,b=/y:1", "names some sources but not the first"),
        ("a=/x:1,a=/y:1", "source a is named twice"),
    ],
)
def test_a_bad_mixture_spec_is_one_line_that_says_what_to_do(spec, says):
    with pytest.raises(MixtureError) as error:
        parse_sources(spec)
    assert says in str(error.value) and "\n" not in str(error.value)


def test_a_yaml_file_lists_the_sources(tmp_path):
    path = tmp_path / "mix.yaml"
    path.write_text(
        "sources:\n"
        "  - {name: laion, data: 's3://a/{000..999}.tar', weight: 0.7}\n"
        "  - name: cc\n    data: [/b/0.tar, /b/1.tar]\n    weight: 3\n"
    )
    assert parse_sources(str(path)) == [
        Source("laion", "s3://a/{000..999}.tar", 0.7),
        Source("cc", "/b/0.tar,/b/1.tar", 3.0),
    ]
    path.write_text("sources:\n  - {name: a, data: /x, weight: 0}\n")
    with pytest.raises(MixtureError, match="positive"):
        parse_sources(str(path))
    path.write_text("- a\n")
    with pytest.raises(MixtureError, match="no list under 'sources:'"):
        parse_sources(str(path))
    with pytest.raises(MixtureError, match="cannot read the sources file"):
        parse_sources(str(tmp_path / "missing.yaml"))


@pytest.mark.parametrize(
    "weights, says",
    [
        ("yes, no", "weight True is not a number"),  # YAML reads yes as a boolean, once taken as 1.0
        ("'heavy', 1", "weight 'heavy' is not a number"),
        ("[1], 1", "weight [1] is not a number"),
        ("1e308, 1e308", "weights a: 1e+308, b: 1e+308 give no share to every source"),  # sum overflows
        ("1.0e308, 1.0e308", "weights a: 1e+308, b: 1e+308 give no share to every source"),
        (f"1{'0' * 400}, 1", "weight inf must be a positive number"),
        (".inf, 1", "weight inf must be a positive number"),
        (".nan, 1", "weight nan must be a positive number"),
    ],
)
def test_a_sources_file_refuses_weights_that_are_no_finite_number(tmp_path, weights, says):
    first, second = weights.split(", ")
    path = tmp_path / "mix.yaml"
    path.write_text(
        f"sources:\n  - {{name: a, data: /x, weight: {first}}}\n  - {{name: b, data: /y, weight: {second}}}\n"
    )
    with pytest.raises(MixtureError) as error:
        parse_sources(str(path))
    assert says in str(error.value) and "\n" not in str(error.value)


def test_the_weights_of_a_spec_whose_shares_overflow_are_refused():
    with pytest.raises(MixtureError, match="give no share to every source"):
        parse_sources("a=/x:1e308,b=/y:1e308")
    assert [s.weight for s in parse_sources("a=/x:1e300,b=/y:1e300")] == [1e300, 1e300]


@pytest.mark.parametrize(
    "text, key, where",
    [
        ("sources:\n  - name: a\n    data: /x\n    data: /y\n", "data", "line 4, column 5"),
        ("sources: [{name: a, data: /x}]\nsources: [{name: b, data: /y}]\n", "sources", "line 2, column 1"),
    ],
)
def test_a_sources_file_with_a_key_given_twice_is_refused_where_it_is(tmp_path, text, key, where):
    # PyYAML keeps the last of a key given twice: the block before it was dropped without a word.
    path = tmp_path / "mix.yaml"
    path.write_text(text)
    with pytest.raises(MixtureError) as error:
        parse_sources(str(path))
    assert str(error.value) == (
        f"the sources file {path} is not plain YAML: {where}: key {key!r} given twice (the first would be "
        "dropped); fix it there"
    )


def test_check_disjoint_names_the_sources_and_their_shared_shards():
    check_disjoint({"a": ["/s/0.tar", "/s/1.tar"], "b": ["/s/2.tar"]})
    shards = [f"/s/{i}.tar" for i in range(6)]
    with pytest.raises(
        MixtureError,
        match=r"^sources a and c both read 5 shard\(s\) \(/s/1.tar, /s/2.tar, /s/3.tar and 2 more\)",
    ):
        check_disjoint({"a": shards, "b": ["/t/0.tar"], "c": shards[1:]})


@pytest.mark.parametrize(
    "text, says",
    [
        ("sources:\n  - {name: a, data: /x\n", "line 3, column 1: expected ',' or '}'"),
        (
            "sources: !!python/object/apply:os.system [echo]\n",
            "line 1, column 10: could not determine a constructor",
        ),
        ("sources:\n\t- a\n", "line 2, column 1: found character '\\t'"),
    ],
)
def test_a_sources_file_that_is_not_plain_yaml_says_where_in_one_line(tmp_path, text, says):
    path = tmp_path / "mix.yaml"
    path.write_text(text)
    with pytest.raises(MixtureError) as error:
        parse_sources(str(path))
    message = str(error.value)
    assert message.startswith(f"the sources file {path} is not plain YAML: {says}")
    assert message.endswith("; fix it there") and "\n" not in message


def test_a_yaml_error_without_a_message_or_a_place_is_named_by_its_type():
    import yaml

    from pipeline.data.mixture import _yaml_problem

    assert _yaml_problem(yaml.YAMLError()) == "YAMLError"
    assert _yaml_problem(yaml.YAMLError("one\ntwo")) == "one"


def test_the_draw_is_a_pure_function_of_seed_epoch_step_rank_and_place():
    a = draw_sources([0.7, 0.3], seed=0, epoch=2, step=5, rank=1, places=64)
    assert np.array_equal(a, draw_sources([0.7, 0.3], seed=0, epoch=2, step=5, rank=1, places=64))
    assert np.array_equal(
        a[:10], draw_sources([0.7, 0.3], seed=0, epoch=2, step=5, rank=1, places=10)
    )  # place by place
    for other in (
        {"seed": 1, "epoch": 2, "step": 5, "rank": 1},
        {"seed": 0, "epoch": 3, "step": 5, "rank": 1},
        {"seed": 0, "epoch": 2, "step": 6, "rank": 1},
        {"seed": 0, "epoch": 2, "step": 5, "rank": 0},
    ):
        assert not np.array_equal(a, draw_sources([0.7, 0.3], places=64, **other)), other
    assert np.array_equal(
        a, draw_sources([7, 3], seed=0, epoch=2, step=5, rank=1, places=64)
    )  # weights are relative


def test_the_drawn_shares_come_close_to_the_weights_over_many_steps():
    weights = [0.6, 0.3, 0.1]
    drawn = np.concatenate(
        [draw_sources(weights, 3, 0, step, rank, 64) for step in range(300) for rank in range(2)]
    )
    shares = np.bincount(drawn, minlength=3) / len(drawn)
    assert np.allclose(shares, weights, atol=0.01), shares


def stream_of(name: str, shards: int, per_shard: int, epochs: list[int]):
    """A source's ``open_pass``: micro-batches of 4 over ``shards`` x ``per_shard`` samples, the first of
    each shard bad (counted into the reader's counts by the test's filter)."""

    def open_pass(passes: int, counts: BadSamples):
        epochs.append(passes)
        for shard in range(shards):
            keys = np.array([f"{name}/{shard}/{i}" for i in range(per_shard)])
            error = np.array(["truncated image: t"] + [""] * (per_shard - 1), dtype=object)
            rows = {"key": keys, "url": np.array([name] * per_shard), "label": np.arange(per_shard)}
            batch = counts.filter({**rows, "error": error})
            for start in range(0, len(batch["key"]), 4):
                yield {c: v[start : start + 4] for c, v in batch.items()}

    return open_pass


def mixed(exhausted: str, *, epoch: int = 0):
    counts, passes = BadSamples(), {"big": [], "small": []}
    readers = [
        SourceReader("big", lambda p: stream_of("big", 4, 9, passes["big"])(p, counts), counts),
        SourceReader("small", lambda p: stream_of("small", 1, 6, passes["small"])(p, counts), counts),
    ]
    stream = mixed_micro_batches(
        readers, [0.7, 0.3], seed=0, rank=0, epoch=epoch, accum=2, size=4, exhausted=exhausted
    )
    return list(stream), counts, passes


def test_each_place_takes_the_source_drawn_for_it_and_a_short_source_cycles():
    batches, counts, passes = mixed("cycle")
    keys = [k for b in batches for k in b["key"].tolist()]
    for index, batch in enumerate(batches[:-1]):  # the last one stops where the epoch ended
        step, micro = divmod(index, 2)
        drawn = draw_sources([0.7, 0.3], 0, 0, step, 0, 8)[micro * 4 : (micro + 1) * 4]
        assert [k.split("/")[0] for k in batch["key"]] == [["big", "small"][s] for s in drawn]
    big = [k for k in keys if k.startswith("big")]
    assert len(big) == len(set(big)) == 32  # the epoch: every big sample once
    assert passes["small"][:2] == [0, 1] and passes["big"] == [0]  # small cycled, big not
    assert counts.sources["small"]["pass"] == len(passes["small"]) >= 2
    assert counts.sources["big"] == {"samples": 32, "bad": 4, "pass": 1, "in_pass": 32}
    assert counts.sources["small"]["samples"] == len(keys) - 32
    assert counts.bad == 4 + counts.sources["small"]["bad"]


def test_with_end_the_first_source_to_run_out_ends_the_epoch():
    batches, counts, passes = mixed("end")
    keys = [k for b in batches for k in b["key"].tolist()]
    assert len(keys) == len(set(keys))  # nothing repeats
    assert counts.sources["small"]["samples"] == 5 and counts.sources["big"]["samples"] < 32
    assert passes["small"] == [0]


def test_another_epoch_draws_other_places():
    a, _, _ = mixed("cycle", epoch=0)
    b, _, _ = mixed("cycle", epoch=1)
    assert [k for x in a for k in x["key"]] != [k for x in b for k in x["key"]]
    assert pass_epoch(3, 0) == 3 and pass_epoch(3, 1) not in (3, pass_epoch(3, 2))


def test_a_source_that_gives_nothing_in_a_pass_stops_with_one_line():
    counts = BadSamples()
    empty = SourceReader("empty", lambda p: iter([]), counts)
    full = SourceReader("full", lambda p: stream_of("full", 8, 9, [])(p, counts), counts)
    with pytest.raises(BadSampleBudgetError, match="source empty gave no readable sample"):
        list(
            mixed_micro_batches(
                [full, empty], [1, 1], seed=0, rank=0, epoch=0, accum=1, size=4, exhausted="cycle"
            )
        )


def indexed_pass(name: str, per_shard: int, counts: BadSamples, passes: list[int]):
    """An ``open_pass`` of one shard whose rows carry their ``index`` and ``shard_size``; sample 1 is bad."""

    def open_pass(p: int):
        passes.append(p)
        index = np.arange(per_shard)
        batch = counts.filter(
            {
                "key": np.array([f"{name}/{i}" for i in index]),
                "url": np.array([name] * per_shard),
                "error": np.array(["" if i != 1 else "truncated image: t" for i in index], dtype=object),
                "index": index,
                "shard_size": np.where(index == per_shard - 1, per_shard, -1),
            }
        )
        yield batch

    return open_pass


def test_a_reader_tags_its_samples_and_bad_ones_with_source_and_pass_and_may_start_later():
    counts, passes = BadSamples(), []
    reader = SourceReader("b", indexed_pass("b", 4, counts, passes), counts, index=1, first=2, begun=3)
    pieces, ran_out = reader.take(2)
    assert passes == [2] and not ran_out and counts.sources["b"]["pass"] == 3
    assert pieces[0]["source"].tolist() == [1, 1] and pieces[0]["pass"].tolist() == [2, 2]
    assert counts.counted == [("b", 1, -1, 1, 2)]  # the bad sample, of source 1, pass 2


def test_a_resumed_pass_may_give_nothing_and_a_finished_first_pass_has_run_out():
    counts = BadSamples()
    # Its part of pass 0 was consumed before the resume: no sample, and no error; pass 1 is read.
    empty = SourceReader("e", lambda p: iter([]), counts, begun=0)
    empty.take(1)
    empty.next_pass()
    assert empty.passes == 1
    with pytest.raises(BadSampleBudgetError):
        empty.next_pass()  # pass 1 was never begun: a fresh pass with nothing is an error
    for exhausted in ("cycle", "end"):
        # Both sources' first passes were complete on the run's union: the epoch is over on this rank.
        done = [
            SourceReader(n, lambda p, n=n: stream_of(n, 1, 6, [])(p, counts), counts, first=1) for n in "ab"
        ]
        stream = mixed_micro_batches(
            done, [1, 1], seed=0, rank=0, epoch=0, accum=1, size=4, exhausted=exhausted
        )
        assert list(stream) == []


def test_readers_sharing_counts_tag_the_bad_samples_of_each_pass_with_their_own_source_and_pass():
    """Two sources' passes read in turn into one rank's counts: each bad sample carries the (source, pass)
    of the pass that counted it, through a pass change, and nothing counted before is retagged."""
    counts = BadSamples()
    counts.counted.append(("earlier", 0, -1))  # counted before, not taken yet: left as it is
    a = SourceReader("a", indexed_pass("a", 4, counts, []), counts, index=0)
    b = SourceReader("b", indexed_pass("b", 4, counts, []), counts, index=1)
    a.take(3)
    b.take(1)
    a.take(1)
    assert a.take(1) == ([], True)  # pass 0 of a ran out
    a.next_pass()
    a.take(1)
    assert counts.take_counted() == [
        ("earlier", 0, -1),
        ("a", 1, -1, 0, 0),
        ("b", 1, -1, 1, 0),
        ("a", 1, -1, 0, 1),
    ]
    assert counts.sources["a"]["bad"] == 2 and counts.sources["b"]["bad"] == 1
