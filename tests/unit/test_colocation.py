"""Colocation's GPU hand-over on the CPU: which of the actor's storages leave the GPU for the engine
(``offload.choose``), and that the actor is asked to free exactly what the engine's wake needs."""

import pytest

from megatron_jetrl.actor.offload import choose
from megatron_jetrl.colocation import Colocation

GROUPS = [("grads", [4, 10], False), ("optimizer", [30, 5, 12], True), ("params", [8, 2], True)]


def test_without_a_need_everything_leaves():
    assert sorted(choose(GROUPS, None)) == sorted((name, i) for name, sizes, _ in GROUPS for i in range(len(sizes)))


@pytest.mark.parametrize("short, picked", [
    (0, []),
    (-5, []),
    (1, [("grads", 1)]),                                   # dropped first: no copy
    (14, [("grads", 1), ("grads", 0)]),
    (15, [("grads", 1), ("grads", 0), ("optimizer", 0)]),  # then the kept groups, largest storage first
    (60, [("grads", 1), ("grads", 0), ("optimizer", 0), ("optimizer", 2), ("optimizer", 1)]),
    (62, [("grads", 1), ("grads", 0), ("optimizer", 0), ("optimizer", 2), ("optimizer", 1), ("params", 0)]),
])
def test_only_what_covers_the_shortfall_leaves_cheapest_first(short, picked):
    assert choose(GROUPS, short) == picked


def test_a_shortfall_beyond_everything_moves_everything():
    assert len(choose(GROUPS, 10**9)) == 7


def test_dropped_groups_go_first_whatever_their_place():
    groups = [("optimizer", [30], True), ("grads", [4], False)]
    assert choose(groups, 3) == [("grads", 0)]


class Actor:
    def __init__(self):
        self.calls = []

    def offload(self, need=None):
        self.calls.append(("offload", need))

    def onload(self):
        self.calls.append(("onload",))


class Engine:
    weights_discarded = False

    def __init__(self):
        self.awake = True

    def wake_bytes(self):
        return 0 if self.awake else 123

    def sleep(self):
        self.awake = False

    def wake(self):
        self.awake = True


def test_the_actor_frees_what_the_engines_wake_needs():
    actor, engine = Actor(), Engine()
    colocation = Colocation(actor, offload_actor=True, sync=lambda: None)
    colocation.start_engine(lambda: engine)
    assert actor.calls == [("offload", None)]  # the engine sizes its KV cache at start: the whole actor off
    colocation.rollout_mode()
    colocation.train_mode()
    assert actor.calls[1:] == [("onload",)] and not engine.awake
    colocation.rollout_mode()
    assert actor.calls[2:] == [("offload", 123)] and engine.awake


def test_without_offloading_the_actor_stays():
    actor, engine = Actor(), Engine()
    colocation = Colocation(actor, offload_actor=False, sync=lambda: None)
    colocation.start_engine(lambda: engine)
    colocation.train_mode()
    colocation.rollout_mode()
    assert actor.calls == [] and engine.awake


def test_an_engine_without_a_bound_gets_the_whole_gpu():
    actor, engine = Actor(), Engine()
    engine.wake_bytes = lambda: None
    colocation = Colocation(actor, offload_actor=True, sync=lambda: None)
    colocation.start_engine(lambda: engine)
    colocation.train_mode()
    colocation.rollout_mode()
    assert actor.calls[-1] == ("offload", None)
