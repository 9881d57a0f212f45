"""The node agent (``rendezvous-run``): its launcher, worker processes, the agent-worker channel and the restart budget."""
