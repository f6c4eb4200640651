"""The project's version, in one place.

pyproject.toml's ``version`` repeats it (a unit test holds the two equal), ``hack/chart.py sync`` stamps it into the
Helm chart's ``version`` and ``appVersion`` (and so into the image tags the chart and manifests/ name),
and ``hack/images.sh`` and ``make release`` tag the images with it. A test holds every other mention of
the images' tag to it.
"""

VERSION = "0.1.0"
