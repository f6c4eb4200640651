"""Two-phase routing through a real gateway process to real runtimes with ``--kv-transfer-role``.

A prefill runtime and a decode runtime of the tiny model (tcp transport on free ports), behind a
gateway serving them as one disaggregated model (``--static-prefill``). A long prompt goes the
``disaggregated`` path: the prefill runtime hands its blocks off and the decode runtime's greedy
answer equals the one a runtime of the same weights gives computing it whole. Sent again, the prompt
goes ``local``: the decode replica now holds its blocks. A short prompt
goes ``local``. With the prefill runtime gone, a long prompt falls back (``fallback``) to the decode
replica computing it whole, with the same answer.
"""

from __future__ import annotations

from gateway_helpers import Started, metric, post_json, wait_ready

FLAGS = ("--block-size", "4", "--max-model-len", "256", "--kv-transfer-port", "0", "--kv-transfer-host", "127.0.0.1")
WORDS = ["river", "stone", "cloud", "lamp", "orchard", "harbor", "violet", "engine", "quiet", "signal"]


def completion(url: str, prompt: str) -> dict:
    status, _, answer = post_json(
        f"{url}/v1/completions", {"model": "tiny", "prompt": prompt, "max_tokens": 6, "temperature": 0}, timeout=120
    )
    assert status == 200, answer
    return answer


def paths(url: str) -> dict[str, float]:
    return {
        p: metric(url, "goodput_gateway_disaggregation_total", path=p) for p in ("disaggregated", "local", "fallback")
    }


def test_long_prompts_prefill_on_the_prefill_pool_short_ones_locally_and_a_lost_pool_falls_back(
    tiny_model_dir, tmp_path
):
    with Started() as started:
        prefill = started.replica("prefill", tiny_model_dir, tmp_path, *FLAGS, "--kv-transfer-role", "prefill")
        decode = started.replica("decode", tiny_model_dir, tmp_path, *FLAGS, "--kv-transfer-role", "decode")
        wait_ready(prefill, decode)
        p_url, d_url = f"http://127.0.0.1:{prefill.port}", f"http://127.0.0.1:{decode.port}"
        g = started.gateway(
            tmp_path / "no-kubeconfig",
            tmp_path / "gateway.log",
            "--static-model",
            f"tiny={d_url}",
            "--static-prefill",
            f"tiny={p_url}",
            "--static-threshold",
            "32",
            "--shutdown-delay",
            "0",
        )
        long_prompt = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(60)) + " again"
        other = " ".join(WORDS[(i * 3) % len(WORDS)] for i in range(60))
        # the references, computed whole by a runtime of the same weights (not the decode replica, which
        # would then hold the prompts and serve them locally)
        references = {p: completion(p_url, p)["choices"][0]["text"] for p in (long_prompt, other)}
        answer = completion(g.url, long_prompt)
        assert answer["choices"][0]["text"] == references[long_prompt]
        assert paths(g.url) == {"disaggregated": 1, "local": 0, "fallback": 0}, g.log()[-3000:]
        assert metric(p_url, "goodput_kv_transfers_total", role="prefill") >= 1
        assert metric(g.url, "goodput_gateway_handoff_seconds_count") == 1

        completion(g.url, "river stone")
        assert paths(g.url)["local"] == 1
        # the decode replica now holds the long prompt's blocks: its uncached part is under the threshold
        assert completion(g.url, long_prompt)["choices"][0]["text"] == references[long_prompt]
        assert paths(g.url) == {"disaggregated": 1, "local": 2, "fallback": 0}

        prefill.stop()
        assert completion(g.url, other)["choices"][0]["text"] == references[other]
        # the pool's endpoint is still listed (no discovery here): the refused prefill falls back
        assert paths(g.url)["fallback"] == 1
        assert "Traceback" not in g.log()
