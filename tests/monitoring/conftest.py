"""The monitoring tier: promtool's checks and unit tests of the shipped rules."""

from helpers import tier

pytest_collection_modifyitems = tier(__file__, "monitoring")
