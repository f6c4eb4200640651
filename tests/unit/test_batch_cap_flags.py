"""The batch cap's flags reach the engine's settings; a bad margin is refused naming the flag."""

import pytest

from goodput_runtime.__main__ import engine_config, parse_args


def test_slo_tpot_turns_the_batch_cap_on_with_its_margin():
    config = engine_config(parse_args(["--model", "m", "--slo-tpot", "80ms", "--batch-cap-margin", "0.3"]))
    assert config.slo_tpot == pytest.approx(0.08)
    assert config.batch_cap == "auto" and config.batch_cap_margin == pytest.approx(0.3)


def test_without_slo_tpot_there_is_no_target_to_cap_from():
    config = engine_config(parse_args(["--model", "m"]))
    assert config.slo_tpot is None


def test_the_batch_cap_can_be_turned_off():
    assert engine_config(parse_args(["--model", "m", "--slo-tpot", "0.1", "--batch-cap", "off"])).batch_cap == "off"


def test_a_margin_outside_zero_to_one_is_refused(capsys, tmp_path):
    with pytest.raises(SystemExit) as exc:
        parse_args(
            ["--model", "m", "--batch-cap-margin", "1.5", "--termination-message-path", str(tmp_path / "termination")]
        )
    assert exc.value.code == 2
    assert "--batch-cap-margin" in capsys.readouterr().err
