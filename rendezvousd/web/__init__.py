"""The HTTP port: ``/metrics`` and the status page (its HTML, CSS and script in ``status_static/``)."""
