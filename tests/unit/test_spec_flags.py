"""The runtime's speculative decoding flags: parsed into the engine's settings, or refused naming the flag."""

from __future__ import annotations

import pytest

from goodput_runtime.__main__ import engine_config, parse_args


def test_speculative_flags_reach_the_engine_settings():
    config = engine_config(
        parse_args(
            [
                "--model",
                "m",
                "--speculative-method",
                "draft",
                "--speculative-model",
                "d",
                "--num-speculative-tokens",
                "5",
                "--speculative-max-batch",
                "0",
                "--ngram-min",
                "2",
                "--ngram-max",
                "3",
            ]
        )
    )
    assert (
        config.speculative_method,
        config.speculative_model,
        config.num_speculative_tokens,
        config.speculative_max_batch,
        config.ngram_min,
        config.ngram_max,
    ) == ("draft", "d", 5, 0, 2, 3)
    assert engine_config(parse_args(["--model", "m"])).speculative_method is None


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--speculative-method", "draft"], "--speculative-method draft needs --speculative-model"),
        (["--speculative-model", "d"], "--speculative-model is only used with --speculative-method draft"),
        (["--speculative-method", "ngram", "--ngram-min", "5"], "--ngram-min 5 exceeds --ngram-max 4"),
        (["--speculative-method", "medusa"], "invalid choice: 'medusa'"),
        (["--num-speculative-tokens", "0"], "must be at least 1"),
    ],
)
def test_bad_speculative_flags_are_refused_naming_them(argv, message, capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        parse_args(["--model", "m", "--termination-message-path", str(tmp_path / "reason"), *argv])
    assert exc.value.code == 2
    assert message in capsys.readouterr().err
