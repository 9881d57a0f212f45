"""Communicators: the interface, the CPU ring and shared-memory transports, and NCCL."""
