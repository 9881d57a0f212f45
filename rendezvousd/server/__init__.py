"""The gRPC surface: the servicer and its streams, answers, faults, auth and metrics."""
