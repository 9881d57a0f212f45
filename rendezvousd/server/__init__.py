"""The gRPC surface: the servicer and its streams, answers, faults, auth and metrics, and the assembly of the daemon."""
