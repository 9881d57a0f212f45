"""``RendezvousError.with_message``: an SDK error re-raised in other words (the trainer's
"this process already holds rank R" for a refused duplicate join) keeps every field
of the daemon's answer; a copy of the fields by hand dropped any field added later."""

from __future__ import annotations

import inspect

import pytest

from rendezvousd.client import errors
from rendezvousd.client.errors import FailedMember, RendezvousError

CLASSES = sorted(
    (c for c in vars(errors).values() if isinstance(c, type) and issubclass(c, RendezvousError)),
    key=lambda c: c.__name__,
)


def _every_field_set(cls: type[RendezvousError]) -> RendezvousError:
    """``cls`` made with each keyword of its own and its bases' constructors set."""
    given: dict[str, object] = {}
    for base in cls.__mro__:
        if not (isinstance(base, type) and issubclass(base, RendezvousError)):
            continue
        for name, param in inspect.signature(base.__init__).parameters.items():
            if param.kind is not inspect.Parameter.KEYWORD_ONLY or name in given:
                continue
            given[name] = {
                "metadata": {"generation": "4", "ranks": "1"},
                "rank": 7,
                "attempts": 3,
                "failed": (FailedMember(1, "host-b", "exit code 1"),),
            }.get(name, f"the {name}")
    return cls("the daemon's words", **given)  # type: ignore[arg-type]


@pytest.mark.parametrize("cls", CLASSES, ids=lambda c: c.__name__)
def test_with_message_keeps_every_field_but_the_message(cls: type[RendezvousError]) -> None:
    error = _every_field_set(cls)
    error.added_later = "a field no constructor names"  # type: ignore[attr-defined]
    again = error.with_message("this process already holds rank 7")
    assert type(again) is cls
    assert str(again) == again.message == "this process already holds rank 7"
    assert again.args == ("this process already holds rank 7",)
    kept = {k: v for k, v in vars(again).items() if k != "message"}
    assert kept == {k: v for k, v in vars(error).items() if k != "message"}
    assert str(error) == "the daemon's words"  # the original is left as it was
