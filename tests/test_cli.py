"""The command line: tables come from the registry, error reports carry the right figures."""

import subprocess
import sys

import pandas as pd
import pytest

import fp4lab.formats as F
from fp4lab.cli import main


def test_formats_lists_every_registered_format_and_recipe(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in F.names(F.FloatFormat) + F.names(F.QuantSpec):
        assert name in out.split()


def test_formats_markdown_rows(capsys):
    main(["formats", "--markdown"])
    out = capsys.readouterr().out
    assert "| fp8_e4m3fn | 8 | SE4M3 | 7 | fn | 448 |" in out
    assert "| nvfp4 | fp4_e2m1 | ue4m3 | 16 | nearest | True | te_encode |" in out


def test_error_report_table_and_csv(tmp_path, capsys):
    csv = tmp_path / "err.csv"
    assert main(["error", "--spec", "nvfp4", "--spec", "mxfp4", "--rows", "8", "--cols", "64", "--csv", str(csv)]) == 0
    frame = pd.read_csv(csv)
    assert set(frame.recipe) == {"nvfp4", "mxfp4"}
    assert set(frame.input) == {"gaussian", "gaussian_logspaced", "heavy_tailed", "outliers"}
    assert "effective_bits" in capsys.readouterr().out


def test_unknown_spec_is_a_clean_error(capsys):
    assert main(["error", "--spec", "nvfp5", "--rows", "2", "--cols", "32"]) == 2
    assert "unknown name 'nvfp5'" in capsys.readouterr().err


def test_python_dash_m_entry_point():
    out = subprocess.run([sys.executable, "-m", "fp4lab", "formats"], capture_output=True, text=True, check=True)
    assert "ue5m3_ieee" in out.stdout


@pytest.mark.parametrize("argv", [[], ["nonsense"]])
def test_bad_commands_exit_nonzero(argv):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2


# -- fp4lab attention ----------------------------------------------------------------------------
SMALL = ["--seq", "96", "--heads", "2", "--head-dim", "32", "--block-m", "32", "--block-n", "32"]


@pytest.fixture(scope="module")
def attention_run(tmp_path_factory):
    """One small run of the default recipes, shared by the tests that read its folder."""
    out = tmp_path_factory.mktemp("attention") / "run"
    import contextlib
    import io

    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        code = main(["attention", "--causal", "--seed", "3", "--out", str(out), *SMALL])
    return code, out, printed.getvalue()


def test_attention_prints_errors_and_saturation(attention_run):
    code, out, printed = attention_run
    assert code == 0
    for word in ("fa4fp4_causal", "fa4fp4_causal_mxfp4pv", "rel_l2", "cosine", "flushed", "clipped", "p_mass_lost"):
        assert word in printed
    assert str(out) in printed


def test_attention_results_folder(attention_run):
    _, out, _ = attention_run
    errors = pd.read_csv(out / "errors.csv")
    assert list(errors["recipe"].unique()) == ["fa4fp4_causal", "fa4fp4_causal_mxfp4pv"]
    assert list(errors["tensor"]) == ["o", "dq", "dk", "dv"] * 2
    assert ((errors["rel_l2"] > 0) & (errors["rel_l2"] < 2)).all()
    trace = pd.read_parquet(out / "trace.parquet")
    assert set(trace["recipe"]) == set(errors["recipe"])
    assert {"prod_err", "a_flushed", "p_mass_lost", "out_err"} <= set(trace.columns)
    assert set(trace["product"]) == {"qk", "pv", "dv", "dp", "dq", "dk", "out"}
    sat = pd.read_csv(out / "saturation.csv")
    assert len(sat) == 24
    for recipe in errors["recipe"].unique():
        assert (out / f"heatmap-{recipe}.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_config_makes_the_run_reproducible(attention_run, tmp_path):
    import json

    _, out, _ = attention_run
    config = json.loads((out / "config.json").read_text())
    assert config["seed"] == 3 and config["arguments"]["causal"] is True
    assert config["inputs"]["kind"] == "synthetic" and config["inputs"]["seq"] == 96
    assert config["recipes"]["fa4fp4_causal"]["q"] == "nvfp4_1level"
    assert {"torch", "numpy", "pandas", "fp4lab", "python", "git_commit"} <= set(config["environment"])
    # rerunning the recorded command gives the same numbers
    again = tmp_path / "again"
    argv = config["command"][1:]
    argv[argv.index("--out") + 1] = str(again)
    assert main(argv) == 0
    pd.testing.assert_frame_equal(pd.read_csv(out / "errors.csv"), pd.read_csv(again / "errors.csv"))


def test_attention_on_a_file_without_do(tmp_path, capsys):
    import json

    from fp4lab.analysis.inputs import save_inputs, synthetic_inputs

    x = synthetic_inputs(seq=64, heads=2, kv_heads=1, head_dim=32)
    path = save_inputs(tmp_path / "act.safetensors", x.q, x.k, x.v)
    out = tmp_path / "run"
    assert main(["attention", "--recipe", "nvfp4", "--inputs", str(path), "--out", str(out),
                 "--block-m", "32", "--block-n", "32"]) == 0
    assert "act.safetensors" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["inputs"]["kind"] == "file" and len(config["inputs"]["sha256"]) == 64
    assert "seed 0" in config["inputs"]["do"]
    assert list(pd.read_csv(out / "errors.csv")["recipe"]) == ["nvfp4"] * 4


def test_attention_default_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["attention", "--recipe", "exact", *SMALL]) == 0
    (folder,) = (tmp_path / "results").iterdir()
    assert folder.name.startswith("attention-") and (folder / "config.json").exists()


def test_attention_defaults_are_small():
    from fp4lab.cli import build_parser

    args = build_parser().parse_args(["attention"])
    assert args.seq is None and args.inputs is None  # the synthetic input's own defaults apply
    from fp4lab.cli import _SIZE_OPTIONS

    assert _SIZE_OPTIONS == {"seq": 512, "heads": 2, "head_dim": 64, "batch": 1}


@pytest.mark.parametrize("argv, message", [
    (["--recipe", "nvfp5"], "unknown name 'nvfp5'"),
    (["--inputs", "nowhere.npz"], "nowhere.npz"),
    (["--seq", "0"], "seq must be a positive int"),
    (["--head-dim", "48", "--recipe", "fa3_fp8_paper"], "power of two"),
    (["--heatmap", "q_tile", "--recipe", "exact", "--seq", "32"], "--heatmap: 'q_tile'"),
])
def test_attention_bad_arguments_are_clean_errors(argv, message, tmp_path, capsys):
    assert main(["attention", "--out", str(tmp_path / "r"), *argv]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "r").exists()  # no half-written results folder


def test_attention_sizes_do_not_mix_with_a_file(tmp_path, capsys):
    from fp4lab.analysis.inputs import save_inputs, synthetic_inputs

    x = synthetic_inputs(seq=32, heads=1, head_dim=32)
    path = save_inputs(tmp_path / "a.npz", x.q, x.k, x.v, x.do)
    assert main(["attention", "--inputs", str(path), "--seq", "64", "--out", str(tmp_path / "r")]) == 2
    assert "--seq" in capsys.readouterr().err
