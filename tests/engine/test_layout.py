"""The rank layout of D copies of a P-stage pipeline (issue 13's hybrid layout, as data)."""

from __future__ import annotations

import itertools

import pytest

from pipemare.engine.layout import RankLayout


def test_two_stages_two_replicas_on_one_node():
    layout = RankLayout(world_size=4, stages=2, devices_per_node=4)
    assert layout.replicas == 2
    assert layout.pipelines == ((0, 1), (2, 3))
    assert layout.stage_groups == ((0, 2), (1, 3))
    assert not layout.pipelines_cross_nodes
    assert [layout.position(r) for r in range(4)] == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_two_nodes_keep_each_pipeline_inside_a_node():
    layout = RankLayout(world_size=4, stages=2, devices_per_node=2)
    assert [layout.node(r) for r in range(4)] == [0, 0, 1, 1]
    assert all(len({layout.node(r) for r in p}) == 1 for p in layout.pipelines)
    # only the stages' gradient all-reduce crosses nodes
    assert all(len({layout.node(r) for r in g}) == 2 for g in layout.stage_groups)
    text = layout.describe()
    assert "pipeline 0: ranks [0, 1] (stage 0 .. 1), node 0" in text
    assert "pipeline 1: ranks [2, 3] (stage 0 .. 1), node 1" in text
    assert "stage 0: [0, 2], stage 1: [1, 3]" in text and "note" not in text


def test_a_pipeline_longer_than_a_node_is_allowed_and_said():
    layout = RankLayout(world_size=4, stages=4, devices_per_node=2)
    assert layout.replicas == 1 and layout.pipelines_cross_nodes
    assert "pipelines span nodes" in layout.describe()


@pytest.mark.parametrize("world,stages", [(w, p) for w in range(1, 13) for p in range(1, w + 1)])
def test_every_rank_has_one_place(world, stages):
    if world % stages:
        with pytest.raises(ValueError, match="cannot run whole copies"):
            RankLayout(world, stages, world)
        return
    layout = RankLayout(world, stages, world)
    flat = sorted(itertools.chain.from_iterable(layout.pipelines))
    assert flat == list(range(world)) == sorted(itertools.chain.from_iterable(layout.stage_groups))
    for rank in range(world):
        replica, stage = layout.position(rank)
        assert layout.pipelines[replica][stage] == rank
        assert rank in layout.stage_groups[stage]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_sizes_are_refused(bad):
    with pytest.raises(ValueError, match="whole number >= 1"):
        RankLayout(4, bad, 2)
