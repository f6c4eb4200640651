"""The typed views of the project's kinds, which the operator and the gateway both read.

Standard library only, like the rest of the contract: a component reads a CR through these
modules and never imports another component to do it.

- ``spec``: ``InferenceService``'s spec, parsed once and refused with the field named.
- ``pipeline_spec``: ``InferencePipeline``'s steps (guard, template, generate).
- ``lora_adapter_spec``: ``LoraAdapter``'s spec (an adapter loaded at run time on a service's replicas).
- ``model_cache_spec``: ``ModelCache``'s spec (a Hub model kept on nodes' local disks).
- ``names``: the names of a service's children and the limits Kubernetes puts on names.
- ``quantity``: Kubernetes quantities (``64Gi``, ``500m``) as numbers.
"""

GROUP = "serving.goodput.dev"
VERSION = "v1alpha1"
API_VERSION = f"{GROUP}/{VERSION}"
KIND = "InferenceService"
PLURAL = "inferenceservices"
PIPELINE_KIND = "InferencePipeline"
PIPELINE_PLURAL = "inferencepipelines"
LORA_KIND = "LoraAdapter"
LORA_PLURAL = "loraadapters"
MODEL_CACHE_KIND = "ModelCache"
MODEL_CACHE_PLURAL = "modelcaches"
