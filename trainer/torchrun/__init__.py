"""``torchrun --rdzv-backend rendezvousd``: the handler (``handler.py``, which imports torch) and its settings (``config.py``, which does not)."""
