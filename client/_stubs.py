"""gRPC's generated stubs, each method made on its first use.

A generated stub makes every method of its service when it is made: 17 of the
Rendezvous service's, ~1 µs each, and each registers its path with the channel's core.
A client uses one or two of them (the heartbeat stream; a unary call only where it has
no call stream, or for a health check), and a cold per-rank client makes its stubs
inside the join (docs/benchmarks.md, session 36). ``lazy_stub`` gives the same
methods, made by the channel with the same arguments as the generated stub's, only
when first asked for: what a stub asks of a channel is read once per process, from
the generated class itself, so a regenerated stub is followed as it is.
"""

from __future__ import annotations

import functools
from typing import Any

_KINDS = ("unary_unary", "unary_stream", "stream_unary", "stream_stream")


class _Recorder:
    """A channel that only records what a generated stub's constructor asks of it:
    the factory (``unary_unary``...) and its arguments, per method."""

    def __getattr__(self, kind: str) -> Any:
        if kind not in _KINDS:
            raise AttributeError(kind)
        return lambda *args, **kwargs: (kind, args, kwargs)


@functools.cache
def _recipes(stub: type) -> dict[str, tuple[str, tuple[Any, ...], dict[str, Any]]]:
    """Per method name of ``stub``: the channel factory it calls and with what."""
    return dict(vars(stub(_Recorder())))


class LazyStub:
    """``stub(channel)``'s methods, each made on first use (then kept, as the stub's)."""

    def __init__(self, stub: type, channel: Any) -> None:
        self._stub_name = stub.__name__
        self._recipes = _recipes(stub)
        self._channel = channel

    def __getattr__(self, name: str) -> Any:
        # Only for names not made yet (and the attributes above, before they are set).
        recipes = self.__dict__.get("_recipes")
        if recipes is None or name not in recipes:
            # The generated stub's own error for a method it does not have.
            raise AttributeError(
                f"'{self.__dict__.get('_stub_name')}' object has no attribute {name!r}"
            )
        kind, args, kwargs = recipes[name]
        method = getattr(self._channel, kind)(*args, **kwargs)
        # Two threads of a sync client may both get here: each makes a method, and either
        # one serves (a multicallable holds no state of its own calls).
        self.__dict__[name] = method
        return method

    def __dir__(self) -> list[str]:
        return sorted({*super().__dir__(), *self._recipes})


def lazy_stub(stub: type, channel: Any) -> Any:
    """``stub(channel)``, its methods made on first use. Typed by its caller: a generated
    stub's type depends on its channel's (``RendezvousAsyncStub`` for grpc.aio's)."""
    return LazyStub(stub, channel)
