"""Concurrency budgets per class of call, enforced around the handlers.

gRPC's own ``maximum_concurrent_rpcs`` is one pool for every call, checked
before authentication: unauthenticated health streams (which cannot carry a
token) could fill it and starve every authenticated call and the health check
itself. So each class (authenticated calls, health checks, health watches) gets
its own ``Gate`` here, and a call beyond its class's cap is refused at once
with RESOURCE_EXHAUSTED naming the limit.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import grpc

from rendezvousd.common import validation
from rendezvousd.errors import RendezvousFault
from rendezvousd.server.fault_status import to_grpc_status


@dataclass
class Gate:
    """How many calls of one class run now, and how many may.

    ``by_job``: which job the running call's token is scoped to (None: the admin's, or
    no token), for a fair share like the parked calls' (``max_waiters``): once the
    gate is within ``reserve`` of its cap, a job already running ``reserve`` calls is
    refused, so that one token holder (a hostile one, or a runaway client) cannot take
    every slot from the other jobs and the admin's own calls (``status``, ListJobs).
    ``job_cap``: the most one job may run at once, however free the gate is (0: no such
    bound), and ``job_cap_why``, the words that say what it allows for: the reserve alone
    let one job hold seven eighths of the cap, more than the daemon's memory holds."""

    limit: str  # the limit's name, as in Limits and the settings
    cap: int
    what: str
    by_job: Callable[[], str | None] | None = None
    job_cap: int = 0
    job_cap_why: str = ""
    active: int = 0
    per_job: dict[str, int] = field(default_factory=dict)
    # Told each refusal and its job ("" for none): the daemon counts and logs it.
    on_refused: Callable[[RendezvousFault, str], None] | None = None

    @property
    def reserve(self) -> int:
        """The last slots, an eighth of the cap (at least one), kept for jobs running
        fewer calls than that and for the admin."""
        return max(1, self.cap // 8)

    async def enter(self, context: Any) -> str | None:
        """Count a call in (or refuse it); the job it is counted for, for ``leave``."""
        if self.active >= self.cap:
            await self._refuse(
                context,
                f"the daemon already runs {self.limit}={self.cap} {self.what}; retry later",
                "",
            )
        job = self.by_job() if self.by_job is not None else None
        if job is not None:
            held = self.per_job.get(job, 0)
            if self.job_cap and held >= self.job_cap:
                await self._refuse(
                    context,
                    f"job {job!r} already runs {held} {self.what}, as many as one job may "
                    f"({self.job_cap_why}) of the daemon's {self.limit}={self.cap}; close "
                    "the calls and streams it no longer needs (one client per member, "
                    "closed when done)",
                    job,
                )
            if held >= self.reserve and self.active >= self.cap - self.reserve:
                await self._refuse(
                    context,
                    f"the daemon runs {self.active} of {self.limit}={self.cap} {self.what} "
                    f"and keeps the last {self.reserve} for jobs running fewer than "
                    f"{self.reserve} and the admin; job {job!r} runs {held}",
                    job,
                )
            self.per_job[job] = held + 1
        self.active += 1
        return job

    async def _refuse(self, context: Any, message: str, job: str) -> None:
        """Refuse the call (``abort_with_status`` raises): RESOURCE_EXHAUSTED for this
        limit, counted and logged for ``job`` ("" for none)."""
        named = {"job_id": job} if job else {}
        fault = validation.limit_exceeded(self.limit, message, **named)
        self._refused(fault, job)
        await context.abort_with_status(to_grpc_status(fault))

    def _refused(self, fault: RendezvousFault, job: str) -> None:
        if self.on_refused is not None:
            self.on_refused(fault, job)

    def leave(self, job: str | None) -> None:
        self.active -= 1
        if job is not None:
            held = self.per_job.pop(job) - 1
            if held:
                self.per_job[job] = held


def handler_shape(handler: grpc.RpcMethodHandler) -> tuple[Any, Any]:
    """``handler``'s behaviour and the grpc factory that makes a handler of its shape
    (unary or streaming request and response), for wrappers that keep the shape."""
    return {
        (False, False): (handler.unary_unary, grpc.unary_unary_rpc_method_handler),
        (True, False): (handler.stream_unary, grpc.stream_unary_rpc_method_handler),
        (False, True): (handler.unary_stream, grpc.unary_stream_rpc_method_handler),
        (True, True): (handler.stream_stream, grpc.stream_stream_rpc_method_handler),
    }[(handler.request_streaming, handler.response_streaming)]


#: Told of a call the gate refused: its context, the abort raised, and the seconds it took.
Refused = Callable[[Any, BaseException, float], None]


def gated(
    handler: grpc.RpcMethodHandler, gate: Gate, refused: Refused | None = None
) -> grpc.RpcMethodHandler:
    """``handler`` with the same shape, counted against ``gate`` while it runs.

    Counting starts inside the handler's own coroutine and ends in its
    ``finally``, so a call cancelled before it started is never counted and one
    that ends in any way is always released. ``refused``: told of each call the gate
    refuses, which ``handler`` never sees (a handler that observes its own calls,
    the servicer's unary ones, would otherwise leave the refusals unobserved).
    """
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    inner, make = handler_shape(handler)
    if inspect.isasyncgenfunction(inner):

        async def stream_gen(request: Any, context: Any) -> AsyncIterator[Any]:
            job = await _enter(gate, context, refused)
            try:
                async for item in inner(request, context):
                    yield item
            finally:
                gate.leave(job)

        return make(stream_gen, **kw)

    # A unary answer, or a streamed one written with ``context.write``.
    async def call(request: Any, context: Any) -> Any:
        job = await _enter(gate, context, refused)
        try:
            return await inner(request, context)
        finally:
            gate.leave(job)

    return make(call, **kw)


async def _enter(gate: Gate, context: Any, refused: Refused | None) -> str | None:
    started = time.perf_counter()
    try:
        return await gate.enter(context)
    except BaseException as error:
        if refused is not None:
            refused(context, error, time.perf_counter() - started)
        raise


def gated_before_body(
    handler: grpc.RpcMethodHandler, gate: Gate, body_timeout_s: float
) -> grpc.RpcMethodHandler:
    """``handler`` counted against ``gate`` from its headers on, not its body.

    grpcio runs a unary-request handler only once the request message arrived, so
    a caller that sends HEADERS and never a body holds a call (~20 KiB) that no
    budget sees. As a request-streaming handler (the same bytes on the wire) it
    runs at once: the gate counts the call, and one whose body does not come
    within ``body_timeout_s`` ends.
    """
    if handler.request_streaming:
        return gated(handler, gate)
    inner = handler.unary_stream if handler.response_streaming else handler.unary_unary

    async def first(requests: AsyncIterator[Any], context: Any) -> Any:
        try:
            return await asyncio.wait_for(anext(aiter(requests)), body_timeout_s)
        except TimeoutError:
            await context.abort(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"no request message within {body_timeout_s:g} s of the call's headers",
            )
        except StopAsyncIteration:
            await context.abort(
                grpc.StatusCode.INVALID_ARGUMENT, "the call ended without its request message"
            )

    make = (
        grpc.stream_stream_rpc_method_handler
        if handler.response_streaming
        else grpc.stream_unary_rpc_method_handler
    )
    kw = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if inspect.isasyncgenfunction(inner):

        async def stream_gen(requests: AsyncIterator[Any], context: Any) -> AsyncIterator[Any]:
            async for item in inner(await first(requests, context), context):
                yield item

        return gated(make(stream_gen, **kw), gate)

    async def call(requests: AsyncIterator[Any], context: Any) -> Any:
        return await inner(await first(requests, context), context)

    return gated(make(call, **kw), gate)
