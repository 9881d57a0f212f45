"""Demo and test helpers shipped in the library, not part of training.

``python -m rendezvousd.trainer.demo`` runs the 2 x 2 demo (``run.py``);
``netns.py`` makes real network hosts in namespaces for the demo's ``--hosts`` and the
multi-host tests.
"""
