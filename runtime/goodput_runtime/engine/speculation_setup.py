"""Speculative decoding set up at start-up: the proposer, and the switch with its timed threshold."""

from __future__ import annotations

import dataclasses
import logging

from goodput_runtime.config import EngineConfig
from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.config_error import EngineConfigError
from goodput_runtime.engine.model_runner import ModelRunner
from goodput_runtime.engine.rank_model import load_for_rank
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.spec_decode.draft import DraftProposer
from goodput_runtime.engine.spec_decode.ngram import NgramProposer
from goodput_runtime.engine.spec_decode.switch import SpeculationSwitch, measure_max_batch, step_costs, timer
from goodput_runtime.loader import check_architecture, load_config, resolve_model_path
from goodput_runtime.metrics import RuntimeMetrics

log = logging.getLogger(__name__)


def configure_speculation(
    config: EngineConfig,
    runner: ModelRunner,
    scheduler: Scheduler,
    metrics: RuntimeMetrics | None,
    model_config,
    num_blocks: int,
) -> None:
    """The proposer (prompt lookup, or the draft model with a KV cache of as many tokens as the
    target's) and the switch, its threshold timed here unless --speculative-max-batch gives it."""
    k = config.num_speculative_tokens
    draft: ModelRunner | None = None
    if config.speculative_method == "draft":
        assert config.speculative_model
        draft_dir = resolve_model_path(config.speculative_model, None)
        check_architecture(draft_dir)
        draft_config = load_config(draft_dir)
        if draft_config.vocab_size != model_config.vocab_size:
            raise EngineConfigError(
                f"--speculative-model has a vocabulary of {draft_config.vocab_size} tokens, the "
                f"model {model_config.vocab_size}: a draft model needs the model's tokenizer"
            )
        draft_model, _ = load_for_rank(dataclasses.replace(config, quantization="none"), draft_dir)
        draft = ModelRunner(draft_model, num_blocks, config.block_size, config.seed)
        runner.proposer = DraftProposer(draft, BlockManager(num_blocks, config.block_size, False), k)
        log.info("Loaded the draft model %s (%d layers)", config.speculative_model, draft_config.num_hidden_layers)
    else:
        # timed at start-up like the switch: the proposal length is chosen per proposal from what steps of
        # 1..k + 1 tokens cost; with --speculative-max-batch nothing is timed and every match proposes k
        costs = step_costs(timer(runner.time_step), k) if config.speculative_max_batch is None else None
        runner.proposer = NgramProposer(k, config.ngram_min, config.ngram_max, costs)
        if costs is not None:
            log.info(
                "Prompt lookup: a step of 1..%d tokens for one sequence costs %s times one of 1 token",
                k + 1,
                ", ".join(map(str, costs)),
            )
    max_batch = config.speculative_max_batch
    if max_batch is None:

        def step(batch: int, tokens: int) -> None:
            runner.time_step(batch, tokens)
            if draft is not None and tokens > 1:  # a verification's proposals cost k draft steps
                for _ in range(k):
                    draft.time_step(batch, 1)

        max_batch, ratios = measure_max_batch(timer(step), k, config.max_num_seqs)
        log.info(
            "Speculative decoding timed: a step of %d tokens per sequence costs %s times one of 1 token "
            "(by running batch); it pays up to %d running requests",
            k + 1,
            ", ".join(f"{b}: {r}" for b, r in ratios.items()),
            max_batch,
        )
    scheduler.switch = SpeculationSwitch(max_batch)
    if metrics is not None:
        metrics.speculation_configured(max_batch, k)
    log.info(
        "Speculative decoding: %s, %d tokens per step, on up to %d running requests%s",
        config.speculative_method,
        k,
        max_batch,
        "; verification steps run eagerly, beside the decode CUDA graphs" if runner.device.type == "cuda" else "",
    )
