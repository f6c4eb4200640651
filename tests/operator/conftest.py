"""The operator tier: a real API server (fixtures in tests/apiserver_fixtures.py) and operator processes."""

from helpers import tier

pytest_collection_modifyitems = tier(__file__, "apiserver")
