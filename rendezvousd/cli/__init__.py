"""The ``rendezvousd`` command (``serve``, ``token``, ``health``, ``status``) and the daemon as a child process.

``python -m rendezvousd.cli`` runs the command (``__main__.py``).
"""
