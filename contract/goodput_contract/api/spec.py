"""A typed view of an InferenceService spec, with the checks the CRD schema cannot make.

Every CR field name lives here. Parsing never touches the API: it turns the spec dict
the server already validated (types, enums, minimums, patterns) into frozen dataclasses,
and raises SpecError naming the field for anything still wrong.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any

from goodput_contract.api import names
from goodput_contract.api.disaggregation_spec import Disaggregation, Pool, parse_disaggregation
from goodput_contract.api.errors import SpecError
from goodput_contract.api.kv_offload_spec import KvOffload, parse_kv_offload
from goodput_contract.api.model_spec import Lora, LoraAdapter, Model, ModelSource, TokenSecretRef, _model, parse_source
from goodput_contract.api.quantity import parse_quantity
from goodput_contract.api.scaling_spec import Autoscaling, Batch, Slo, _autoscaling, _batch, _slo, parse_duration
from goodput_contract.api.template_spec import PodTemplate, _check, _check_secret_ref, _template

# Names other modules import from here, whichever module of the contract defines them
__all__ = [
    "Autoscaling",
    "Batch",
    "Disaggregation",
    "KvOffload",
    "Lora",
    "LoraAdapter",
    "Model",
    "ModelSource",
    "PodTemplate",
    "Pool",
    "ServiceSpec",
    "Slo",
    "SpecError",
    "TokenSecretRef",
    "parse",
    "parse_duration",
    "parse_source",
]

DEFAULT_GPU_RESOURCE = "nvidia.com/gpu"
MAX_NAME_LENGTH = 55  # "<name>-runtime" must stay a 63-character DNS label
_NAME = re.compile(r"^[a-z]([-a-z0-9]*[a-z0-9])?$")
ROUTING_POLICIES = ("prefix", "least-load", "random")
INT32_MAX = 2**31 - 1  # replica counts are int32 in Deployments, PodDisruptionBudgets and autoscalers


@dataclass(frozen=True)
class Speculative:
    method: str  # ngram | draft
    tokens: int = 3
    draft_model: ModelSource | None = None  # method draft


@dataclass(frozen=True)
class Engine:
    kind: str = "goodput"  # goodput | vllm | sglang: the row of engines.ENGINES that serves it
    image: str | None = None  # overrides the engine's default image
    max_num_seqs: int | None = None
    max_batched_tokens: int | None = None
    prefix_caching: bool | None = None
    gpu_memory_utilization: float = 0.9
    max_queue: int | None = None
    extra_args: tuple[str, ...] = ()
    speculative: Speculative | None = None
    kv_offload: KvOffload | None = None  # engine.kvOffload: the second KV tier (kv_offload_spec.py)


@dataclass(frozen=True)
class Resources:
    gpu: int
    gpu_resource_name: str = DEFAULT_GPU_RESOURCE
    cpu: str | None = None
    memory: str | None = None
    gpu_memory: str | None = None
    gpu_product: str | None = None
    gpus_per_node: int | None = None  # GPUs one node offers: a replica needing more spans several pods


@dataclass(frozen=True)
class Routing:
    policy: str = "prefix"  # prefix | least-load | random: how the gateway picks a replica


@dataclass(frozen=True)
class SecretKeyRef:
    name: str
    key: str


@dataclass(frozen=True)
class Auth:
    api_key_secret: SecretKeyRef | None = None  # the runtime gets it as an environment variable


@dataclass(frozen=True)
class ServiceSpec:
    name: str
    namespace: str
    model: Model
    engine: Engine
    tensor_parallel: int
    resources: Resources
    slo: Slo
    autoscaling: Autoscaling
    replicas: int | None
    image: str | None
    template: PodTemplate
    routing: Routing = Routing()
    batch: Batch = field(default_factory=Batch)
    auth: Auth = Auth()
    network_policy: bool = True
    pipeline_parallel: int = 1  # parallelism.pipeline: stages the layers are split into
    pods_per_replica: int = 1  # parallelism.nodes, or the GPUs over resources.gpusPerNode
    suspend: bool = False  # spec.suspend: held at zero replicas, children kept
    disaggregation: Disaggregation | None = None  # spec.disaggregation: separate prefill and decode pools

    @property
    def ranks(self) -> int:
        """Processes (GPUs on a GPU replica) one replica runs: tensor × pipeline."""
        return self.tensor_parallel * self.pipeline_parallel

    @property
    def multi_node(self) -> bool:
        """One replica is a group of pods (a StatefulSet or a LeaderWorkerSet group), not one pod."""
        return self.pods_per_replica > 1

    @property
    def desired_replicas(self) -> int:
        """spec.replicas when set (the scale subresource writes it); else the autoscaler's floor; 0 while suspended.
        Disaggregated, these are the decode pool's replicas, within its bounds."""
        if self.suspend:
            return 0
        if self.disaggregation is not None:
            decode = self.disaggregation.decode
            return decode.clamp(self.replicas if self.replicas is not None else decode.min_replicas)
        return self.replicas if self.replicas is not None else self.autoscaling.min_replicas


def _quantity(value: Any, field_path: str) -> str | None:
    if value is None:
        return None
    try:
        amount = parse_quantity(value)
    except ValueError:
        raise SpecError(field_path, f"{value!r} is not a Kubernetes quantity") from None
    if amount < 0:
        raise SpecError(field_path, f"{value!r} is negative")
    return str(value)


def _engine(raw: dict[str, Any]) -> Engine:
    return Engine(
        kind=raw.get("kind") or "goodput",
        image=raw.get("image"),
        max_num_seqs=raw.get("maxNumSeqs"),
        max_batched_tokens=raw.get("maxBatchedTokens"),
        prefix_caching=raw.get("prefixCaching"),
        gpu_memory_utilization=float(raw.get("gpuMemoryUtilization", 0.9)),
        max_queue=raw.get("maxQueue"),
        extra_args=tuple(raw.get("extraArgs") or ()),
        speculative=_speculative(raw["speculative"]) if raw.get("speculative") else None,
    )


def _speculative(raw: dict[str, Any]) -> Speculative:
    method = raw.get("method")
    if method not in ("ngram", "draft"):
        raise SpecError("engine.speculative.method", f"{method!r} is not one of ngram, draft")
    draft = raw.get("draftModel")
    if method == "draft" and not draft:
        raise SpecError("engine.speculative.draftModel", "is required with method draft", reason="DraftModelMissing")
    if method != "draft" and draft:
        raise SpecError("engine.speculative.draftModel", f"is only used with method draft, not {method}")
    source = None
    if draft:
        try:
            source = parse_source(draft)
        except SpecError as err:
            raise SpecError("engine.speculative.draftModel", str(err).split(": ", 1)[1]) from None
    return Speculative(method=method, tokens=int(raw.get("tokens", 3)), draft_model=source)


def _resources(raw: dict[str, Any], tensor: int, pipeline: int = 1) -> Resources:
    ranks = tensor * pipeline
    gpu = int(raw.get("gpu", ranks))
    if gpu not in (0, ranks):
        shape = f"parallelism.tensor={tensor}" + (f" × parallelism.pipeline={pipeline}" if pipeline > 1 else "")
        raise SpecError(
            "resources.gpu",
            f"is {gpu} but each replica runs {shape} GPUs (use {ranks}, or 0 for CPU)",
            reason="GPUCountMismatch",
        )
    per_node = raw.get("gpusPerNode")
    if per_node is not None and int(per_node) < 1:
        raise SpecError("resources.gpusPerNode", f"is {per_node}; it must be at least 1")
    return Resources(
        gpu=gpu,
        gpu_resource_name=raw.get("gpuResourceName") or DEFAULT_GPU_RESOURCE,
        cpu=_quantity(raw.get("cpu"), "resources.cpu"),
        memory=_quantity(raw.get("memory"), "resources.memory"),
        gpu_memory=_quantity(raw.get("gpuMemory"), "resources.gpuMemory"),
        gpu_product=raw.get("gpuProduct"),
        gpus_per_node=int(per_node) if per_node is not None else None,
    )


def _pods_per_replica(parallelism: dict[str, Any], resources: Resources, ranks: int) -> int:
    """Pods one replica spans: parallelism.nodes when set, else one per node of resources.gpusPerNode
    GPUs when the replica's GPUs exceed one node, else 1. Each pod runs ranks / pods ranks."""
    nodes = parallelism.get("nodes")
    per_node = resources.gpus_per_node if resources.gpu else None
    if nodes is None:
        if per_node is None or ranks <= per_node:
            return 1
        if ranks % per_node:
            raise SpecError(
                "resources.gpusPerNode",
                f"is {per_node}, which does not divide the replica's {ranks} GPUs (tensor × pipeline): "
                "each pod of a replica runs an equal share",
                reason="ShapeDoesNotFit",
            )
        return ranks // per_node
    nodes = int(nodes)
    if nodes < 1 or ranks % nodes:
        raise SpecError(
            "parallelism.nodes",
            f"is {nodes}, which does not divide the replica's {ranks} ranks (tensor × pipeline)",
            reason="ShapeDoesNotFit",
        )
    if per_node is not None and ranks // nodes > per_node:
        raise SpecError(
            "parallelism.nodes",
            f"is {nodes}: each pod would need {ranks // nodes} GPUs, more than resources.gpusPerNode {per_node}",
            reason="ShapeDoesNotFit",
        )
    return nodes


def _routing(raw: dict[str, Any]) -> Routing:
    policy = raw.get("policy") or "prefix"
    if policy not in ROUTING_POLICIES:
        raise SpecError("routing.policy", f"{policy!r} is not one of {', '.join(ROUTING_POLICIES)}")
    return Routing(policy=policy)


def _auth(raw: dict[str, Any]) -> Auth:
    ref = raw.get("apiKeySecretRef")
    if not ref:
        return Auth()
    return Auth(SecretKeyRef(ref["name"], ref.get("key") or "apiKey"))


def _check_references(spec: dict[str, Any], parsed: ServiceSpec) -> None:
    """Names the spec passes on into its children, by the API server's rules for them."""
    _check_secret_ref("model.tokenSecretRef", (spec.get("model") or {}).get("tokenSecretRef"))
    _check_secret_ref("auth.apiKeySecretRef", (spec.get("auth") or {}).get("apiKeySecretRef"))
    if parsed.model.cache_claim:
        _check("model.cacheClaimName", names.dns_subdomain(parsed.model.cache_claim))
    if parsed.image is not None:
        _check("image", names.image(parsed.image))
    if parsed.engine.image is not None:
        _check("engine.image", names.image(parsed.engine.image))
    if parsed.resources.gpu:
        _check("resources.gpuResourceName", names.extended_resource(parsed.resources.gpu_resource_name))
        if parsed.resources.gpu_product:
            _check("resources.gpuProduct", names.label_value(parsed.resources.gpu_product))
    for field_path, count in (
        ("replicas", parsed.replicas),
        ("autoscaling.minReplicas", parsed.autoscaling.min_replicas),
        ("autoscaling.maxReplicas", parsed.autoscaling.max_replicas),
    ):
        if count is not None and count > INT32_MAX:
            raise SpecError(field_path, f"is {count}, above {INT32_MAX}", reason="TooLarge")


def parse(name: str, namespace: str, spec: dict[str, Any]) -> ServiceSpec:
    """The typed spec, or SpecError naming the first field to fix."""
    if len(name) > MAX_NAME_LENGTH or not _NAME.match(name):
        raise SpecError(
            "metadata.name",
            f"{name!r} must be a DNS label of at most {MAX_NAME_LENGTH} characters starting with a letter",
            reason="InvalidName",
        )
    parallelism = spec.get("parallelism") or {}
    tensor = int(parallelism.get("tensor", 1))
    pipeline = int(parallelism.get("pipeline", 1))
    if pipeline < 1:
        raise SpecError("parallelism.pipeline", f"is {pipeline}; it must be at least 1")
    resources = _resources(spec.get("resources") or {}, tensor, pipeline)
    replicas = spec.get("replicas")
    parsed = ServiceSpec(
        name=name,
        namespace=namespace,
        model=_model(spec.get("model") or {}, name),
        engine=_engine(spec.get("engine") or {}),
        tensor_parallel=tensor,
        resources=resources,
        slo=_slo(spec.get("slo") or {}),
        autoscaling=(autoscaling := _autoscaling(spec.get("autoscaling") or {})),
        replicas=int(replicas) if replicas is not None else None,
        image=spec.get("image"),
        template=_template(spec.get("template") or {}),
        routing=_routing(spec.get("routing") or {}),
        batch=_batch(spec.get("batch") or {}, autoscaling),
        auth=_auth(spec.get("auth") or {}),
        network_policy=bool(spec.get("networkPolicy", True)),
        pipeline_parallel=pipeline,
        pods_per_replica=_pods_per_replica(parallelism, resources, tensor * pipeline),
        suspend=bool(spec.get("suspend", False)),
    )
    engine = parsed.engine
    if (spec.get("engine") or {}).get("kvOffload") is not None:
        offload = parse_kv_offload(spec["engine"]["kvOffload"], resources.gpu, tensor * pipeline, engine.prefix_caching)
        parsed = replace(parsed, engine=(engine := replace(engine, kv_offload=offload)))
    if spec.get("disaggregation") is not None:
        parsed = replace(
            parsed,
            disaggregation=parse_disaggregation(
                spec["disaggregation"],
                engine.kind,
                tensor,
                engine.extra_args,
                pipeline,
                parsed.pods_per_replica,
                resources.gpus_per_node if resources.gpu else None,
            ),
        )
    speculative = parsed.engine.speculative
    draft = speculative.draft_model if speculative else None
    if (
        draft is not None
        and draft.scheme == "pvc"
        and (parsed.model.source.scheme != "pvc" or draft.claim != parsed.model.source.claim)
    ):
        raise SpecError(
            "engine.speculative.draftModel",
            "may name a claim only when it is the model's own (pvc:// of model.source), which the pod mounts",
            reason="DraftClaimNotMounted",
        )
    _check_references(spec, parsed)
    if parsed.model.node_cache is not None:
        _check("model.nodeCache", names.dns_subdomain(parsed.model.node_cache))
        if parsed.model.source.scheme != "hf" or parsed.model.source.file:
            raise SpecError(
                "model.nodeCache",
                "reads a ModelCache, which holds a Hub repository: model.source must be hf://org/name",
                reason="NodeCacheNeedsHubSource",
            )
    if parsed.model.source.scheme == "pvc" and parsed.model.cache_claim == parsed.model.source.claim:
        raise SpecError(
            "model.cacheClaimName",
            "must differ from the model's source claim, which is mounted read-only",
            reason="CacheClaimIsSource",
        )
    return parsed
