"""The launcher reads the elastic rendezvous's event names off the frame
(``launcher._cheap_rendezvous_event_names``): the same names torch's own
``get_method_name`` reads off ``inspect.stack()``, at every depth it is asked for."""
from __future__ import annotations

from torch.distributed.elastic.rendezvous import dynamic_rendezvous

from fxpipe.job import launcher


def _names(get_method_name):
    """What a recorder named ``_record``, called from ``next_rendezvous``, is named by
    ``get_method_name`` at depths 0-3, and at a depth past the stack's bottom."""
    def _record(depth):
        return get_method_name(depth) if depth is not None else get_method_name()

    def next_rendezvous():
        return (_record(None), _record(0), _record(1), _record(2), _record(3), _record(10_000))

    return next_rendezvous()


def test_event_names_equal_torchs(monkeypatch):
    original = dynamic_rendezvous.get_method_name
    monkeypatch.setattr(dynamic_rendezvous, "get_method_name", original)  # put back after the test
    launcher._cheap_rendezvous_event_names()
    assert dynamic_rendezvous.get_method_name is not original
    assert _names(dynamic_rendezvous.get_method_name) == _names(original)
    assert _names(original)[0] == "next_rendezvous" and _names(original)[-1] == "no_method_name"
