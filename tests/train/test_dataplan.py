"""The worker loop's narrow interfaces: the data plan it asks for its input (`pipeline.train.input.dataplan`),
and no function in pipeline/ handed the whole trainer, or its state, untyped. What a plan trains on,
step by step, is tested against recorded runs (`tests.train.test_golden`)."""

from __future__ import annotations

import ast
from pathlib import Path

import torch

from pipeline.train.input.cursor import stream_fingerprint
from pipeline.train.input.dataplan import MixedSources, OneSource, plan_for
from pipeline.train.input.feeder import FeederPlan, feeder_plan_for
from pipeline.train.input.position import EpochPosition
from pipeline.train.input.source_position import SourcesPosition
from pipeline.train.state import Rank
from tests.configs import tiny_config
from tests.train.test_loop import SHARDS
from tests.train.test_sources import SOURCES

PIPELINE = Path(__file__).resolve().parents[2] / "pipeline"


def plan(data: dict, data_cpus: float | None = 1.0):
    config = tiny_config(micro_batch_size=4)
    me = Rank(0, 1, torch.device("cpu"), None, accum=2)
    loop_config = {**data, "data_cpus_per_worker": data_cpus}
    return plan_for(loop_config, config, config.data_for(8), me, ("patches", "label")), config


def test_a_plain_data_is_one_source_with_the_stream_and_position_of_one():
    one, config = plan({"shards": SHARDS})
    assert isinstance(one, OneSource)
    # The fingerprint checkpoints of one source have always recorded: they still resume at the sample.
    assert one.fingerprint == stream_fingerprint(SHARDS, config.run.seed, config.data_for(8).shuffle_buffer)
    position = one.position()
    assert isinstance(position, EpochPosition) and position.shards == SHARDS
    assert one.metrics(None, None) == {}  # no collective, nothing in the metrics rows


def test_a_plan_takes_the_drivers_data_cpus_or_none():
    """None (no --data-cpus-per-worker): the rank's share is decided per epoch, as the driver hands it."""
    for data_cpus in (None, 3.0):
        assert plan({"shards": SHARDS}, data_cpus)[0].data_cpus == data_cpus


def test_with_data_process_feeder_the_plan_is_the_same_plan_in_a_feeder():
    """What the loop reads of a plan beside its step inputs is the inline plan's; its feeder starts with
    the first epoch's input, not before (`tests.train.test_feeder` runs one)."""
    config = tiny_config(micro_batch_size=4)
    me = Rank(0, 1, torch.device("cpu"), None, accum=2)
    urls = [url for s in SOURCES for url in s["shards"]]
    for data, kind in (({"shards": SHARDS}, OneSource), ({"shards": urls, "sources": SOURCES}, MixedSources)):
        loop_config = {**data, "data_cpus_per_worker": 1.0}
        inline = plan_for(loop_config, config, config.data_for(8), me, ("patches", "label"))
        assert isinstance(feeder_plan_for(loop_config, config, config.data_for(8), me, ("patches",)), kind)
        fed = feeder_plan_for(
            loop_config, config.replace(data_process="feeder"), config.data_for(8), me, ("patches", "label")
        )
        assert isinstance(fed, FeederPlan) and isinstance(fed.inline, kind) and fed.feeder is None
        assert fed.fingerprint == inline.fingerprint and fed.cpus(0) == inline.cpus(0) == 1.0
        assert type(fed.position()) is type(inline.position())
        fed.close()  # nothing started: nothing to stop


def test_sources_are_mixed_with_a_position_per_source():
    urls = [url for s in SOURCES for url in s["shards"]]
    mixed, _ = plan({"shards": urls, "sources": SOURCES})
    assert isinstance(mixed, MixedSources)
    assert isinstance(mixed.position(), SourcesPosition) and mixed.position().names == ["big", "small"]
    one, _ = plan({"shards": urls})
    assert mixed.fingerprint != one.fingerprint  # a mixed checkpoint is not re-read as one source's


def untyped_trainer_parameters() -> list[str]:
    """Functions in pipeline/ that take a ``trainer`` or ``state`` parameter as ``Any`` or untyped."""
    found = []
    for path in sorted(PIPELINE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            arguments = node.args.posonlyargs + node.args.args + node.args.kwonlyargs
            for arg in arguments:
                if arg.arg in ("trainer", "state") and (
                    arg.annotation is None or ast.unparse(arg.annotation) == "Any"
                ):
                    found.append(f"{path.relative_to(PIPELINE.parent)}:{node.lineno} {node.name}({arg.arg})")
    return found


def test_no_function_in_pipeline_takes_the_trainer_or_its_state_untyped():
    assert untyped_trainer_parameters() == []
