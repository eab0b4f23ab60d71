"""torchelastic's rendezvous names its steps through ``inspect.stack()`` (~1 s of a launch's CPU);
deepshard.launch.rendezvous_names gives the same names by a frame lookup.  Checked against torch's own
function, called from the same places."""

from __future__ import annotations

import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic_rendezvous

from deepshard.launch import rendezvous_names
from deepshard.launch.rendezvous_names import method_name, name_steps_cheaply


def _torchs():
    """torch's own get_method_name (a launch in this process may have installed ours already)."""
    return rendezvous_names.replaced.get("get_method_name", dynamic_rendezvous.get_method_name)


def test_torch_still_names_its_steps_with_get_method_name():
    # if this fails, torch changed how the rendezvous names its steps: see rendezvous_names.py
    assert name_steps_cheaply()
    torchs = _torchs()
    assert torchs is not method_name and torchs.__module__ == dynamic_rendezvous.__name__
    assert dynamic_rendezvous.get_method_name is method_name


def test_the_names_equal_torchs_at_every_depth():
    torchs = _torchs()

    def record(get, depth):  # as torch's _record calls it: its caller's name at depth 2
        return get(depth)

    def a_rendezvous_step(get, depth):
        return record(get, depth)

    for depth in range(1, 8):  # depth 0 is the naming function itself
        assert a_rendezvous_step(method_name, depth) == a_rendezvous_step(torchs, depth), depth
    assert a_rendezvous_step(method_name, 2) == "a_rendezvous_step"
    assert method_name(10_000) == torchs(10_000) == "no_method_name"


def test_a_rendezvous_handlers_steps_get_their_methods_names():
    """torch's handler, through the installed function: the recorded name is the calling method's."""
    name_steps_cheaply()

    class Handler:
        def _record(self):
            return f"{self.__class__.__name__}.{dynamic_rendezvous.get_method_name()}"

        def next_rendezvous(self):
            return self._record()

    assert Handler().next_rendezvous() == "Handler.next_rendezvous"
