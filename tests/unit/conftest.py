"""The unit tier: pure functions and in-process objects, no cluster, no server process, no download.

Gateway, operator and contract tests here import no torch; runtime bookkeeping tests import it
through the runtime modules they test.
"""

from helpers import tier

pytest_collection_modifyitems = tier(__file__, "unit")
