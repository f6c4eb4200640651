"""Goodput's operator (``python -m goodput_operator``): kopf handlers reconciling InferenceService and
InferencePipeline, and the goodput autoscaler. It reads CRs through ``goodput_contract.api`` and talks to
the API server only through ``k8s``."""
