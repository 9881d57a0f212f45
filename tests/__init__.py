import os

#: GRPC_VERBOSITY as the test run was given it, before ``rendezvousd.trainer`` (imported
#: by the tests' support) sets its default: ``tests/conftest.py`` gives each test this
#: one, so that daemons the tests start keep gRPC's INFO lines that some tests count.
GRPC_VERBOSITY_AT_START = os.environ.get("GRPC_VERBOSITY")
