"""The unit tier: pure functions and in-process objects, no cluster, no server process, no download.

The gateway's, operator's and autoscaler's tests here import no torch (test_boundaries.py checks it);
the runtime's bookkeeping tests import it through the modules they test, and so does test_contract.py,
which feeds the operator's args to the runtime's own parser.
"""

from helpers import tier

pytest_collection_modifyitems = tier(__file__, "unit")
