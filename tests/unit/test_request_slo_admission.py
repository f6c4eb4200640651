"""A request's own SLO targets: read from its headers, judged by admission instead of the server's, and by the
goodput counters when it finishes; and the detokenizer's token boundaries a stream's ids are reported at."""

from types import SimpleNamespace

import pytest

from goodput_runtime.engine.block_manager import BlockManager
from goodput_runtime.engine.detokenizer import IncrementalDetokenizer
from goodput_runtime.engine.scheduler import Scheduler
from goodput_runtime.engine.sequence import Sequence
from goodput_runtime.metrics import RuntimeMetrics
from goodput_runtime.request_times import RequestTimes
from goodput_runtime.sampling import SamplingParams
from goodput_runtime.server.admission import Admission, AdmissionSettings, StepRates
from goodput_runtime.server.errors import APIError
from goodput_runtime.server.request_slo import RequestSLO, request_slo, with_slo


def test_headers_ours_first_then_llm_ds_in_milliseconds():
    assert request_slo({}) == RequestSLO()
    assert request_slo({"x-goodput-slo-ttft-ms": "250", "x-llm-d-slo-ttft-ms": "9"}) == RequestSLO(0.25)
    assert request_slo({"x-llm-d-slo-tpot-ms": "40"}) == RequestSLO(None, 0.04)
    for bad in ("0", "-1", "fast", "nan", "inf"):
        with pytest.raises(APIError) as refused:
            request_slo({"x-goodput-slo-tpot-ms": bad})
        assert refused.value.status == 400 and refused.value.param == "x-goodput-slo-tpot-ms"
    params = with_slo(SamplingParams(), RequestSLO(0.25, 0.04))
    assert (params.slo_ttft, params.slo_tpot) == (0.25, 0.04)


def busy_engine() -> SimpleNamespace:
    """Two seats taken by requests with 100 tokens to go and two waiting: a newcomer waits ~200 steps."""
    s = Scheduler(BlockManager(256, 4), 2, 64, 4096)
    params = SamplingParams(max_tokens=100, temperature=0.0, ignore_eos=True)
    for i in range(4):
        s.add(Sequence.new(f"r{i}", [10 + i] * 8, params, 0.0))
    s.schedule()
    return SimpleNamespace(scheduler=s)


def admission(ttft: float | None) -> Admission:
    a = Admission(AdmissionSettings(ttft_target=ttft, margin=0.0))
    a.rates = StepRates()
    a.rates.prefill_token_seconds, a.rates.decode_step_seconds = 0.001, 0.01
    return a


def test_a_tight_own_ttft_is_refused_where_the_servers_admits_and_a_loose_one_admitted_where_it_refuses():
    engine = busy_engine()
    lenient, strict = admission(60.0), admission(0.01)
    lenient.check(engine, 8, SamplingParams())
    with pytest.raises(APIError) as refused:
        lenient.check(engine, 8, SamplingParams(slo_ttft=0.01))
    assert refused.value.status == 429 and "exceeds the 0.01s target" in refused.value.message
    with pytest.raises(APIError):
        strict.check(engine, 8, SamplingParams())
    headers = strict.check(engine, 8, SamplingParams(slo_ttft=60.0))
    assert 0.01 < float(headers["x-goodput-predicted-ttft"]) < 60
    # without any server target, a request carrying its own is still judged
    with pytest.raises(APIError):
        admission(None).check(engine, 8, SamplingParams(slo_ttft=0.01))


def test_goodput_is_judged_by_the_requests_own_targets():
    metrics = RuntimeMetrics("m", slo_ttft=1.0, slo_tpot=None)
    times = RequestTimes(arrival=0.0, first_token=0.5, finished=1.0, num_output_tokens=2)
    assert metrics.record_finished(times)
    times.slo_ttft = 0.1
    assert not metrics.record_finished(times)
    assert metrics.record_finished(RequestTimes(0.0, None, 5.0, 6.0, num_output_tokens=2, slo_ttft=10.0))


class PieceTokenizer:
    """Token i is the i-th two-character piece (the prompt's tokens decode to nothing)."""

    PIECES = ["ab", "cd", "ef", "gh", "ij", "kl"]

    def decode(self, ids, skip_special_tokens=True):
        return "".join(self.PIECES[i] for i in ids if i < len(self.PIECES))


def test_with_stop_strings_the_text_handed_out_is_whole_tokens_and_shown_counts_them():
    pieces = PieceTokenizer.PIECES
    detok = IncrementalDetokenizer(PieceTokenizer(), [99, 99], ("XYZ",))  # 2 characters held back
    text = ""
    for i in range(len(pieces)):
        detok.add(i)
        text += detok.delta(False)
        # whole tokens only: the text out is that of the tokens counted as shown, and holds back at least 2
        assert text == "".join(pieces[: detok.shown_tokens])
        assert len(text) <= max(0, 2 * (i + 1) - 2)
    assert detok.shown_tokens == len(pieces) - 1
    text += detok.delta(True)
    assert text == "".join(pieces) and detok.shown_tokens == len(pieces)
