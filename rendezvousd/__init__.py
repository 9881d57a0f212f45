"""rendezvousd: authenticated gRPC rendezvous for multi-node data-parallel training."""
