"""The ModelFits condition and status.capacity: the model's config.json checked against the spec's shape,
and its memory plan (for each role's replicas, with spec.disaggregation)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from goodput_contract.api.spec import ServiceSpec, SpecError
from goodput_operator import capacity, engines, kv_offload_pod, roles
from goodput_operator.conditions import FALSE, MODEL_FITS, TRUE, UNKNOWN, Condition
from goodput_operator.context import Context


@dataclass(frozen=True)
class Fit:
    condition: Condition
    capacity: dict[str, Any] | None = None
    invalid: SpecError | None = None  # a fact about the model makes the spec unservable


async def model_fit(ctx: Context, svc: ServiceSpec) -> Fit:
    problem = capacity.quantization_problem(svc.model.quantization, svc.resources)
    if problem:
        return Fit(
            Condition(MODEL_FITS, FALSE, "QuantizationUnsupported", problem),
            invalid=SpecError("model.quantization", problem, reason="QuantizationUnsupported"),
        )
    source = svc.model.source
    if source.scheme != "hf":
        return Fit(Condition(MODEL_FITS, UNKNOWN, "ConfigNotFetched", "config.json is only fetched for hf:// sources"))

    async def token() -> str | None:
        ref = svc.model.token_secret
        return await ctx.kube.secret_value(svc.namespace, ref.name, ref.key) if ref else None

    result = ctx.fetcher.lookup(source.repo, svc.model.revision, token, (svc.namespace, svc.name), source.file)
    if result is None:
        what = (
            f"config.json or the GGUF header of {source.repo}/{source.file}"
            if source.file
            else f"config.json of {source.repo}"
        )
        return Fit(Condition(MODEL_FITS, UNKNOWN, "FetchingConfig", f"fetching {what}"))
    if result.config is None:
        return Fit(Condition(MODEL_FITS, UNKNOWN, "ConfigUnavailable", result.error or ""))
    config = result.config
    # other engines serve architectures of their own; they say so at start-up
    problem = capacity.architecture_problem(config) if svc.engine.kind == engines.GOODPUT else None
    if problem:
        return Fit(
            Condition(MODEL_FITS, FALSE, "ArchitectureUnsupported", problem),
            invalid=SpecError("model.source", problem, reason="ArchitectureUnsupported"),
        )
    problem = capacity.tensor_parallel_problem(config, svc.tensor_parallel)
    if problem:
        return Fit(
            Condition(MODEL_FITS, FALSE, "TensorParallelMismatch", problem),
            invalid=SpecError("parallelism.tensor", problem, reason="TensorParallelMismatch"),
        )
    problem = capacity.pipeline_problem(config, svc.pipeline_parallel)
    if problem:
        return Fit(
            Condition(MODEL_FITS, FALSE, "PipelineMismatch", problem),
            invalid=SpecError("parallelism.pipeline", problem, reason="PipelineMismatch"),
        )
    draft_source = svc.engine.speculative.draft_model if svc.engine.speculative else None
    draft = None
    if draft_source is not None and draft_source.scheme == "hf":  # the draft model counts in the plan too
        fetched = ctx.fetcher.lookup(draft_source.repo, "main", token, (svc.namespace, svc.name), draft_source.file)
        if fetched is None:
            return Fit(
                Condition(
                    MODEL_FITS,
                    UNKNOWN,
                    "FetchingConfig",
                    f"fetching config.json of the draft model {draft_source.repo}",
                )
            )
        if fetched.config is None:
            return Fit(Condition(MODEL_FITS, UNKNOWN, "ConfigUnavailable", f"draft model: {fetched.error or ''}"))
        draft = fetched.config
        if draft.vocab_size != config.vocab_size:
            problem = (
                f"has a vocabulary of {draft.vocab_size} tokens, the model {config.vocab_size}: a draft model "
                "needs the model's tokenizer"
            )
            return Fit(
                Condition(MODEL_FITS, FALSE, "DraftModelMismatch", problem),
                invalid=SpecError("engine.speculative.draftModel", problem, reason="DraftModelMismatch"),
            )
    utilization = svc.engine.gpu_memory_utilization
    tensors = {role: roles.role_spec(svc, role).tensor_parallel for role in roles.ROLES} if svc.disaggregation else {}
    for role, tensor in tensors.items():
        if tensor != svc.tensor_parallel and (problem := capacity.tensor_parallel_problem(config, tensor)):
            return Fit(
                Condition(MODEL_FITS, FALSE, "TensorParallelMismatch", f"{role}: {problem}"),
                invalid=SpecError(f"disaggregation.{role}.tensor", problem, reason="TensorParallelMismatch"),
            )

    def plan(tensor: int) -> capacity.Capacity:
        return capacity.plan(
            config,
            dtype=svc.model.dtype,
            quantization=svc.model.quantization,
            tensor=tensor,
            max_model_len=svc.model.max_model_len,
            device_memory_bytes=capacity.device_memory_bytes(svc.resources),
            utilization=utilization,
            draft=draft,
            pipeline=svc.pipeline_parallel,
        )

    try:  # spec.engine.kvOffload's tier in the plan: its bytes and the tokens they hold
        offload = kv_offload_pod.plan_status(svc, capacity.kv_bytes_per_token(config, svc.model.dtype))
    except SpecError as err:
        return Fit(Condition(MODEL_FITS, FALSE, "OffloadTooSmall", str(err)), invalid=err)
    if not tensors:
        fit = _fit_condition(plan(svc.tensor_parallel), utilization)
    else:
        pools = capacity.Pools({role: (tensor, plan(tensor)) for role, tensor in tensors.items()})
        fit = _fit_condition(pools, utilization)
    if fit.capacity is not None:
        fit.capacity.update(offload)
    return fit


def _fit_condition(plan: capacity.Capacity | capacity.Pools, utilization: float) -> Fit:
    message = plan.describe(utilization)
    if plan.fits is None:
        condition = Condition(MODEL_FITS, UNKNOWN, "DeviceMemoryUnknown", message)
    elif plan.fits:
        condition = Condition(MODEL_FITS, TRUE, "ModelFits", message)
    else:
        condition = Condition(MODEL_FITS, FALSE, "ModelTooLarge", message)
    return Fit(condition, plan.as_status())
