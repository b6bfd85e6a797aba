"""Every experiment's tiny preset runs end to end, writes well-formed results, and is not re-run."""

import json

import pytest

from vitkit.cli import main
from vitkit.experiments import EXPERIMENTS, config_hash, experiment


def test_config_hash_ignores_key_order_and_sees_values():
    assert config_hash({"a": 1, "b": [1, 2]}) == config_hash({"b": [1, 2], "a": 1})
    assert config_hash({"a": 1}) != config_hash({"a": 2})


def test_unknown_experiment_and_preset_are_named():
    with pytest.raises(ValueError, match="posemb"):
        experiment("posembs")
    with pytest.raises(ValueError, match="tiny"):
        experiment("posemb", preset="huge")


@pytest.mark.slow
def test_every_tiny_experiment_writes_results_and_a_second_call_trains_nothing(tmp_path, capsys):
    for name, exp in EXPERIMENTS.items():
        result = experiment(name, preset="tiny", out=tmp_path, threads=1, progress=False)
        data = json.loads(result.files["results"].read_text())
        assert data["experiment"] == name and data["preset"] == "tiny" and data["records"]
        assert result.files["plot"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        table = result.files["table"].read_text()
        assert table.count("\n|") == len(data["table"]) + 2  # header, rule, one line per point
        for record in data["records"]:
            assert set(record["labels"]) >= {exp.series}
            assert record["params"] > 0 and record["gflops"] > 0
            for metric, value in record["metrics"].items():
                if metric == "attention_distance":
                    assert all(d >= 0 for layer in value for d in layer)
                else:
                    assert 0.0 <= value <= 1.0, (name, metric, value)
        assert any(m in r["metrics"] for r in data["records"] for m in ("accuracy", "attention_distance"))
    partial = json.loads((tmp_path / "partial-finetuning" / "results.json").read_text())["table"]
    trainable = {row["labels"]["trainable"]: row["trainable_params"] for row in partial}
    assert trainable["head"] < trainable["attention"] < trainable["full"] == partial[0]["params"]
    # Resumable: the same call again (here through the CLI) finds every run done.
    capsys.readouterr()
    assert main(["experiment", "data-scaling", "--preset", "tiny", "--out", str(tmp_path), "--threads", "1"]) == 0
    assert "0 training run(s) and 0 measurement(s)" in capsys.readouterr().out
