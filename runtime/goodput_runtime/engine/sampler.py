"""Next-token choice from logits, batched over the step's sampling rows.

In order, as vLLM applies them: a grammar's token mask (one bitmask for every row that has a
grammar, applied on the logits' device), logit bias and the minimum length (EOS and stop tokens held
off), then the repetition, frequency and presence penalties (the latter two count the generated
tokens, and the prompt's last `output_in_prompt` ones: a resumed stream's earlier output), then
temperature; greedy rows take the argmax there, random rows drop tokens by min-p, top-k and top-p
and draw one. Every stage is a tensor operation over the whole batch (the penalties count each
row's tokens with one `scatter_add` into a [rows, vocab] tensor); no Python loop touches the
vocabulary. A step whose rows are all greedy with nothing to change takes the plain argmax, exactly
as before.

Reported logprobs are `log_softmax` of the logits at the point the token is chosen: after the
grammar mask (a token it rules out reports the floor), the bias, minimum-length mask, penalties
and temperature (a greedy request's temperature 0 divides nothing), before min-p, top-k and top-p
drop tokens. Prompt logprobs are the model's own distribution.

Draws use exponential noise: the argmax of probs / E with E ~ Exp(1) per token is a draw from
probs. Rows with a seed take their noise from their own generator, so their tokens do not
depend on what else is in the batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from goodput_runtime.engine.outputs import TokenLogprob
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.structured.grammar import Grammar, allocate_bitmask, apply_bitmask, fill_bitmasks

LOGIT_BIAS_LIMIT = 100.0


def row_argmax(scores: torch.Tensor) -> torch.Tensor:
    """Each row's argmax (the first of equal maxima, as torch.argmax). On a CPU through numpy's vectorized
    argmax, in float32: torch's runs on the whole vocabulary several times slower there (64 rows of SmolLM2's
    49,152 logits: 4.0 ms on two threads against 0.5, or 1.3 with a bf16 row converted first)."""
    if scores.device.type != "cpu":
        return scores.argmax(dim=-1)
    return torch.from_numpy(scores.detach().float().numpy().argmax(axis=-1))


@dataclass(slots=True)
class SampleRow:
    """What the sampler needs of one sampling row: its settings, generator key and tokens so far."""

    params: SamplingParams
    key: tuple[str, int]  # request id and choice index
    token_ids: list[int]  # the prompt followed by the output so far
    num_prompt_tokens: int
    grammar: Grammar | None = None  # the choice's grammar matcher: tokens it rules out are never drawn

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens


class Sampler:
    def __init__(self, seed: int = 0, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.seed = seed
        self.eos_token_ids = eos_token_ids  # held off by min_tokens unless a request ignores EOS
        self.shared: dict[torch.device, torch.Generator] = {}
        self.seeded: dict[str, dict[int, torch.Generator]] = {}  # request id -> choice -> its generator

    def sample(self, logits: torch.Tensor, rows: list[SampleRow]) -> tuple[list[int], list[TokenLogprob | None]]:
        """The next token of each row, and its logprobs where the row asked for them. logits: [N, V]."""
        params = [r.params for r in rows]
        if any(r.grammar is not None for r in rows):
            logits = self.mask(logits, rows)
        if all(p.greedy and not p.penalized and p.logprobs is None for p in params):
            return row_argmax(logits).tolist(), [None] * len(rows)
        logits = logits.float()
        if any(p.penalized for p in params):
            logits = self.process(logits, rows)
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        scores = logits
        temperatures = [p.temperature if p.temperature > 0 else 1.0 for p in params]
        if any(t != 1.0 for t in temperatures):  # temperature 0 is greedy: those rows stay as they are
            scores = logits / torch.tensor(temperatures, device=logits.device)[:, None]
        tokens = row_argmax(scores)
        if random_rows:
            index = torch.tensor(random_rows, device=logits.device)
            tokens[index] = self._draw(scores[index], [rows[i] for i in random_rows])
        token_list = tokens.tolist()
        return token_list, self._logprobs(scores, token_list, params)

    @staticmethod
    def mask(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Tokens each row's grammar rules out set to -inf: one bitmask for the batch, filled on the CPU,
        applied on the logits' device. Rows without a grammar are untouched."""
        logits = logits.float()
        # a copy on the calling thread on CPU: torch's parallel copy waits on its slowest thread
        logits = torch.from_numpy(logits.detach().numpy().copy()) if logits.device.type == "cpu" else logits.clone()
        at = [i for i, r in enumerate(rows) if r.grammar is not None]
        bitmask = allocate_bitmask(len(rows), logits.shape[-1])
        fill_bitmasks([(grammar, i) for i, r in enumerate(rows) if (grammar := r.grammar) is not None], bitmask)
        apply_bitmask(logits, bitmask, at)
        return logits

    def forget(self, request_id: str) -> None:
        self.seeded.pop(request_id, None)

    def process(self, logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """Logit bias, the minimum-length mask and the penalties, over the whole batch."""
        n, vocab = logits.shape
        device = logits.device
        logits = logits.clone()
        bias = [(i, t, b) for i, r in enumerate(rows) for t, b in r.params.logit_bias if 0 <= t < vocab]
        if bias:
            at = torch.tensor([[i for i, _, _ in bias], [t for _, t, _ in bias]], device=device)
            values = torch.tensor(
                [max(-LOGIT_BIAS_LIMIT, min(LOGIT_BIAS_LIMIT, b)) for _, _, b in bias],
                device=device,
                dtype=logits.dtype,
            )
            logits.index_put_((at[0], at[1]), values, accumulate=True)
        held = [
            (i, t)
            for i, r in enumerate(rows)
            if r.num_output_tokens < r.params.min_tokens
            for t in self._stop_ids(r.params)
            if 0 <= t < vocab
        ]
        if held:
            at = torch.tensor(held, device=device)
            logits[at[:, 0], at[:, 1]] = float("-inf")
        repetition = [r.params.repetition_penalty for r in rows]
        if any(p != 1.0 for p in repetition):
            seen = self._bins(rows, vocab, device, lambda r: r.token_ids if r.params.repetition_penalty != 1.0 else [])
            penalty = torch.tensor(repetition, device=device, dtype=logits.dtype)[:, None].expand(n, vocab)
            scaled = torch.where(logits > 0, logits / penalty, logits * penalty)
            logits = torch.where(seen > 0, scaled, logits)
        frequency = [r.params.frequency_penalty for r in rows]
        presence = [r.params.presence_penalty for r in rows]
        if any(frequency) or any(presence):
            counts = self._bins(
                rows,
                vocab,
                device,
                lambda r: (
                    r.token_ids[r.num_prompt_tokens - r.params.output_in_prompt :]
                    if r.params.frequency_penalty or r.params.presence_penalty
                    else []
                ),
            )
            logits -= torch.tensor(frequency, device=device, dtype=logits.dtype)[:, None] * counts
            logits -= torch.tensor(presence, device=device, dtype=logits.dtype)[:, None] * (counts > 0)
        return logits

    def _stop_ids(self, p: SamplingParams) -> set[int]:
        return set(p.stop_token_ids) | (set() if p.ignore_eos else set(self.eos_token_ids))

    @staticmethod
    def _bins(
        rows: list[SampleRow], vocab: int, device: torch.device, tokens: Callable[[SampleRow], list[int]]
    ) -> torch.Tensor:
        """[N, V] counts of each row's tokens, by one scatter_add over a padded [N, L] id tensor."""
        lists = [tokens(r) for r in rows]
        width = max(1, max(len(t) for t in lists))
        # ids past the vocabulary (and the padding) land in one extra bin, dropped below
        padded = torch.tensor([ids + [vocab] * (width - len(ids)) for ids in lists], device=device).clamp_(0, vocab)
        counts = torch.zeros(len(rows), vocab + 1, device=device)
        counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))
        return counts[:, :vocab]

    @staticmethod
    def probabilities(scores: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """[M, V] what random rows draw from: softmax(scores) after min-p, top-k and top-p (not
        renormalized after them: a draw by exponential noise needs no normalization)."""
        vocab = scores.shape[1]
        device = scores.device
        probs = scores.softmax(dim=-1)
        if any(p.min_p > 0 for p in params):
            min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
            probs = probs.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, 0.0)
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        if any(k < vocab for k in top_k) or any(p.top_p < 1.0 for p in params):
            ordered, order = probs.sort(dim=-1, descending=True)
            rank = torch.arange(vocab, device=device)[None, :]
            keep = rank < torch.tensor(top_k, device=device)[:, None]
            ordered = ordered * keep
            normalized = ordered / ordered.sum(dim=-1, keepdim=True)
            before = normalized.cumsum(dim=-1) - normalized  # mass of the likelier tokens
            keep &= before < torch.tensor([p.top_p for p in params], device=device)[:, None]
            keep[:, 0] = True  # the likeliest token always stays
            probs = torch.zeros_like(probs).scatter_(1, order, ordered * keep)
        return probs

    def _draw(self, scores: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
        """One token per row from softmax(scores) after min-p, top-k and top-p. scores: [M, V]."""
        vocab = scores.shape[1]
        device = scores.device
        params = [r.params for r in rows]
        probs = self.probabilities(scores, params)
        noise = torch.empty_like(probs)
        unseeded = [i for i, p in enumerate(params) if p.seed is None]
        if unseeded:
            draws = torch.empty(len(unseeded), vocab, device=device)
            draws.exponential_(generator=self._shared(device))
            noise[torch.tensor(unseeded, device=device)] = draws
        for i, row in enumerate(rows):
            if row.params.seed is not None:
                noise[i].exponential_(generator=self._generator(row, device))
        return row_argmax(probs / noise)

    def _shared(self, device: torch.device) -> torch.Generator:
        if device not in self.shared:
            self.shared[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self.shared[device]

    def _generator(self, row: SampleRow, device: torch.device) -> torch.Generator:
        request_id, index = row.key
        choices = self.seeded.setdefault(request_id, {})
        if index not in choices:
            seed = row.params.seed
            assert seed is not None
            choices[index] = torch.Generator(device=device).manual_seed(seed)
        return choices[index]

    @staticmethod
    def _logprobs(scores: torch.Tensor, tokens: list[int], params: list[SamplingParams]) -> list[TokenLogprob | None]:
        result: list[TokenLogprob | None] = [None] * len(params)
        wanted = [i for i, p in enumerate(params) if p.logprobs is not None]
        if not wanted:
            return result
        index = torch.tensor(wanted, device=scores.device)
        chosen = torch.tensor([tokens[i] for i in wanted], device=scores.device)
        for i, entry in zip(
            wanted, logprob_rows(scores[index], chosen, [params[i].logprobs or 0 for i in wanted]), strict=True
        ):
            result[i] = entry
        return result


def logprob_rows(logits: torch.Tensor, chosen: torch.Tensor, ks: list[int]) -> list[TokenLogprob]:
    """Per row: the chosen token's log_softmax and the row's k likeliest, in float32. logits: [N, V]."""
    logprobs = logits.float().log_softmax(dim=-1)
    picked = logprobs.gather(1, chosen[:, None])[:, 0].tolist()
    k = max(ks, default=0)
    top_values: list[list[float]] = [[] for _ in ks]
    top_ids: list[list[int]] = [[] for _ in ks]
    if k:
        values, ids = logprobs.topk(min(k, logprobs.shape[-1]), dim=-1)
        top_values, top_ids = values.tolist(), ids.tolist()
    return [
        TokenLogprob(token, value, list(zip(top_ids[i][: ks[i]], top_values[i][: ks[i]], strict=True)))
        for i, (token, value) in enumerate(zip(chosen.tolist(), picked, strict=True))
    ]
