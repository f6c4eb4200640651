"""The gateway tier: `python -m goodput_gateway` processes in front of real runtime processes.

Tests that discover services from a real API server (the `cluster` fixture, tests/apiserver_fixtures.py)
are also marked `apiserver`; the Batch API's tests serve a static model and need none.
"""

from helpers import tier

pytest_collection_modifyitems = tier(__file__, "gateway", when={"apiserver": "cluster"})
