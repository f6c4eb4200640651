"""The rules that operator, runtime and gateway must agree on, in one pure-Python package.

It imports nothing beyond the standard library (no torch, no kubernetes client), so every
component can depend on it. Each module holds one kind of rule:

- ``metrics``: the names of the series the runtime exports and the autoscaler and dashboards read.
"""
