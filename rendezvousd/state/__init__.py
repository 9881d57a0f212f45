"""The state machine: every decision, no I/O, no clock, no asyncio (``machine.RendezvousState``)."""
