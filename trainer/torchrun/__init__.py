"""``torchrun --rdzv-backend rendezvousd``: the handler (``handler.py``, which imports torch), its settings (``config.py``) and the workers' store port (``store_port.py``), which do not."""
