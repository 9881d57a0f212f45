"""The same store operations on torch's TCPStore and on rendezvousd's DaemonStore (a
one-node round of the torchrun handler); prints both answer lists as one JSON line.

    python torch_store_contract.py ENDPOINT TOKEN_FILE JOB_ID
"""

from __future__ import annotations

import json
import os
import sys
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch.distributed.elastic.rendezvous import RendezvousClosedError, RendezvousParameters

from rendezvousd.trainer.torchrun.handler import create_handler


def ops(store: Any) -> list[Any]:
    out: list[Any] = []

    def record(what: str, call: Any) -> None:
        try:
            value = call()
            out.append([what, value.decode() if isinstance(value, bytes) else value])
        except Exception as exc:  # the kind of failure is part of the contract
            out.append([what, type(exc).__name__])

    record("set str", lambda: store.set("a", "x"))
    record("get", lambda: store.get("a"))
    record("set bytes", lambda: store.set("b", b"\x00\xff"))
    record("get bytes", lambda: list(store.get("b")))
    record("add new", lambda: store.add("n", 3))
    record("add again", lambda: store.add("n", -1))
    record("get counter", lambda: store.get("n"))
    record("cas absent, empty expected", lambda: store.compare_set("c", "", "one"))
    record("cas wrong expected", lambda: store.compare_set("c", "nope", "two"))
    record("cas right expected", lambda: store.compare_set("c", "one", "three"))
    record("cas absent, some expected", lambda: store.compare_set("d", "x", "y"))
    record("set empty", lambda: store.set("e", b""))
    record("cas empty value, empty expected", lambda: store.compare_set("e", "", "full"))
    record("get swapped", lambda: store.get("e"))
    # torch's append() is a compare_set loop starting from an empty expected.
    record("set empty again", lambda: store.set("f", b""))
    record("append to empty", lambda: store.append("f", "x"))
    record("get appended", lambda: store.get("f"))
    record("check present", lambda: store.check(["a", "c"]))
    record("check absent", lambda: store.check(["a", "zz"]))
    record("delete present", lambda: store.delete_key("a"))
    record("delete absent", lambda: store.delete_key("a"))
    record("multi_set", lambda: store.multi_set(["m1", "m2"], ["v1", "v2"]))
    record("multi_get", lambda: [v.decode() for v in store.multi_get(["m1", "m2"])])
    record("wait present", lambda: store.wait(["m1"]))
    record("wait absent", lambda: store.wait(["never"], timedelta(milliseconds=200)))
    # A year (init_process_group(timeout=...) with "forever" in mind) is a wait, not an error.
    store.set_timeout(timedelta(days=365))
    record("get, timeout a year", lambda: store.get("m1"))
    record("wait, a year", lambda: store.wait(["m2"], timedelta(days=365)))
    store.set_timeout(timedelta(seconds=5))
    prefixed = dist.PrefixStore("round/1", store)
    record("prefix set", lambda: prefixed.set("k", "v"))
    record("prefix get", lambda: prefixed.get("k"))
    record("prefix add", lambda: prefixed.add("k2", 2))
    return out


def main() -> None:
    endpoint, token_file, job = sys.argv[1:4]
    tcp = dist.TCPStore(
        "127.0.0.1", 0, None, True, timeout=timedelta(seconds=5), wait_for_workers=False
    )
    # The token file through the environment: the handler's other settings layer.
    os.environ["RENDEZVOUSD_TOKEN_FILE"] = token_file
    params = RendezvousParameters(
        backend="rendezvousd", endpoint=endpoint, run_id=job, min_nodes=1, max_nodes=1
    )
    handler = create_handler(params)
    info = handler.next_rendezvous()
    info.store.set_timeout(timedelta(seconds=5))
    result: dict[str, Any] = {"tcpstore": ops(tcp), "daemon": ops(info.store)}
    # set_closed(): this agent says no more rounds; a next_rendezvous() is refused.
    handler.set_closed()
    try:
        handler.next_rendezvous()
        refused = "no"
    except RendezvousClosedError:
        refused = "RendezvousClosedError"
    result["closed"] = [handler.is_closed(), refused]
    handler.shutdown()
    # shutdown() of a round still running, twice: the second has nothing left to tell
    # and succeeds, as c10d's does.
    params.run_id = f"{job}-shutdown"
    handler = create_handler(params)
    handler.next_rendezvous()
    result["shutdown"] = [handler.shutdown(), handler.shutdown()]
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
