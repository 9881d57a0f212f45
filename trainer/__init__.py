"""Training side: topology, communicators, bucketed all-reduce, launcher."""
