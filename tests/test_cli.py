"""The command line: tables come from the registry, names fail with their kind's names closest
first, every argument is checked before anything is computed, a results folder reruns from its
config.json alone to the same bits. Behaviours that depend on a fresh process (--import, a
rerun without it, the pipe, warnings, figures) run `python -m fp4lab` in a subprocess."""

import argparse
import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pandas as pd
import pytest

import fp4lab.formats as F
from fp4lab.cli import build_parser, main
from fp4lab.config import from_fields
from fp4lab.recipes import AttentionRecipe

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--seq", "96", "--heads", "2", "--head-dim", "32", "--block-m", "32", "--block-n", "32"]
TINY = ["--seq", "64", "--heads", "1", "--head-dim", "32", "--block-m", "32", "--block-n", "32"]


def fp4lab(*argv, cwd=None, **kwargs) -> subprocess.CompletedProcess:
    """`python -m fp4lab ARGV` in a fresh process."""
    return subprocess.run(
        [sys.executable, "-m", "fp4lab", *argv], cwd=cwd, capture_output=True, text=True, **kwargs
    )


def python(script: str, cwd=None) -> subprocess.CompletedProcess:
    """A script in a fresh interpreter; its last stdout line is JSON."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], cwd=cwd, capture_output=True, text=True
    )


# -- fp4lab formats, recipes, error -------------------------------------------------------------
def test_formats_lists_every_number_and_block_format_with_its_rounding(capsys):
    assert main(["formats"]) == 0
    out = capsys.readouterr().out
    for name in F.names(F.FloatFormat) + F.names(F.QuantSpec):
        assert name in out.split()
    rows = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "nearest_even" in rows["nvfp4"] and "stochastic" in rows["nvfp4_sr"]
    assert "Number formats (FloatFormat)" in out and "Block formats (QuantSpec)" in out
    assert "`fp4lab recipes`" in out  # where the attention recipes are


def test_formats_markdown_rows(capsys):
    main(["formats", "--markdown"])
    out = capsys.readouterr().out
    assert "| fp8_e4m3fn | 8 | SE4M3 | 7 | fn | 448 |" in out
    assert "| nvfp4 | fp4_e2m1 | ue4m3 | 16 | nearest | True | te_encode | nearest_even |" in out


def test_recipes_lists_every_recipe_with_its_operands(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    header = next(line for line in out.splitlines() if line.split()[:1] == ["name"])
    assert header.split() == [
        "name",
        "summary",
        "mask",
        "source",
        "qk",
        "pv",
        "dv",
        "dp",
        "dq",
        "dk",
    ]
    for name in F.names(AttentionRecipe):
        assert re.search(rf"^\s*{name}\s", out, flags=re.M), name
    assert "nvfp4_1level / nvfp4_1level" in out  # fa4fp4_causal's qk


def test_recipes_name_prints_one_in_full(capsys):
    assert main(["recipes", "sageattn3"]) == 0
    out = capsys.readouterr().out
    recipe = F.get("sageattn3")
    assert recipe.doc.strip().splitlines()[-1] in out and recipe.source in out
    assert re.search(r"p_lift\s+2688", out) and re.search(r"p\s+nvfp4_divide_unrounded", out)
    assert main(["recipes", "fa4fp4_causal", "--json"]) == 0
    fields = json.loads(capsys.readouterr().out)
    assert from_fields(AttentionRecipe, fields) == F.get("fa4fp4_causal")


def test_error_report_table_and_csv(tmp_path, capsys):
    csv = tmp_path / "err.csv"
    argv = ["error", "--format", "nvfp4", "--spec", "mxfp4", "--rows", "8", "--cols", "64"]
    assert main([*argv, "--csv", str(csv)]) == 0
    frame = pd.read_csv(csv)
    assert list(frame.columns[:2]) == ["format", "input"]
    assert set(frame["format"]) == {"nvfp4", "mxfp4"}  # --spec is --format's alias
    assert set(frame.input) == {"gaussian", "gaussian_logspaced", "heavy_tailed", "outliers"}
    assert "effective_bits" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv, first, kind",
    [
        (["error", "--format", "nvfp5"], "nvfp4", F.QuantSpec),
        (["attention", "--recipe", "fa4fp4_casual"], "fa4fp4_causal", None),
        (["recipes", "sagattn3"], "sageattn3", None),
    ],
)
def test_unknown_names_list_their_kind_closest_first(argv, first, kind, capsys):
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "unknown" in err and "closest first: " + first in err
    listed = err.split("closest first: ")[1].split(" and ")[0].split(", ")
    if kind is not None:
        assert all(isinstance(F.get(name), kind) for name in listed)


def test_a_name_of_another_kind_says_what_it_is(capsys):
    assert main(["error", "--format", "fa4fp4_causal"]) == 2
    assert "unknown block format 'fa4fp4_causal' (it names an attention recipe)" in (
        capsys.readouterr().err
    )


def _actions(parser: argparse.ArgumentParser, path: str = "fp4lab"):
    """(command path, action) for every option of every (sub)command."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from _actions(sub, f"{path} {name}")
        elif not isinstance(action, argparse._HelpAction):
            yield path, action


def test_every_option_has_help_and_every_command_a_sentence():
    parser = build_parser()
    for path, action in _actions(parser):
        assert action.help and action.help != argparse.SUPPRESS, f"{path} {action.option_strings}"
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for choice in commands._choices_actions:
        assert re.fullmatch(r"[A-Z].+\.", choice.help), choice.dest
    assert {"--import"} <= {
        o for p, a in _actions(parser) if p == "fp4lab attention" for o in a.option_strings
    }


def test_reductions_are_the_plots():
    from fp4lab.analysis import plots
    from fp4lab.cli import REDUCTIONS

    assert REDUCTIONS == plots.REDUCTIONS


def test_python_dash_m_entry_point():
    out = fp4lab("formats")
    assert out.returncode == 0 and "ue5m3_ieee" in out.stdout


@pytest.mark.parametrize("argv", [[], ["nonsense"]])
def test_bad_commands_exit_nonzero(argv):
    with pytest.raises(SystemExit) as err:
        main(argv)
    assert err.value.code == 2


# -- fp4lab attention, in this process ----------------------------------------------------------
@pytest.fixture(scope="module")
def attention_run(tmp_path_factory):
    """One small run of the default recipes, shared by the tests that read its folder."""
    import contextlib
    import io

    out = tmp_path_factory.mktemp("attention") / "run"
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        argv = ["attention", "--causal", "--seed", "3", "--out", str(out), "--quiet", *SMALL]
        code = main(argv)
    return code, out, printed.getvalue()


def test_attention_prints_errors_and_saturation(attention_run):
    code, out, printed = attention_run
    assert code == 0
    words = ("fa4fp4_causal", "fa4fp4_causal_mxfp4pv", "rel_l2", "cosine", "flushed", "clipped")
    for word in (*words, "p_mass_lost"):
        assert word in printed
    assert str(out) in printed


def test_attention_results_folder(attention_run):
    _, out, _ = attention_run
    errors = pd.read_csv(out / "errors.csv", keep_default_na=False)
    assert list(errors["recipe"].unique()) == ["fa4fp4_causal", "fa4fp4_causal_mxfp4pv"]
    assert list(errors["tensor"]) == ["o", "dq", "dk", "dv"] * 2
    assert ((errors["rel_l2"] > 0) & (errors["rel_l2"] < 2)).all() and set(errors["note"]) == {""}
    trace = pd.read_parquet(out / "trace.parquet")
    assert set(trace["recipe"]) == set(errors["recipe"])
    assert {"prod_err", "a_flushed", "p_mass_lost", "out_err"} <= set(trace.columns)
    assert set(trace["product"]) == {"qk", "pv", "dv", "dp", "dq", "dk", "out"}
    assert len(pd.read_csv(out / "saturation.csv")) == 24
    for png in [f"heatmap-{r}.png" for r in errors["recipe"].unique()] + ["heatmaps.png"]:
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_attention_errors_are_compare_s(attention_run):
    """The CLI shares one exact reference between recipes; its numbers are compare's."""
    from fp4lab import compare
    from fp4lab.analysis import synthetic_inputs

    _, out, _ = attention_run
    x = synthetic_inputs(seq=96, heads=2, head_dim=32, seed=3)
    errors = pd.read_csv(out / "errors.csv")
    for recipe in ("fa4fp4_causal", "fa4fp4_causal_mxfp4pv"):
        want = compare(
            x.q, x.k, x.v, x.do, recipe, causal=True, generator=3, block_m=32, block_n=32
        )
        got = errors[errors["recipe"] == recipe].drop(columns="note").reset_index(drop=True)
        pd.testing.assert_frame_equal(got, want.errors, check_exact=False, rtol=1e-12)


def test_attention_config_records_every_field(attention_run):
    _, out, _ = attention_run
    config = json.loads((out / "config.json").read_text())
    run = config["run"]
    assert run["seed"] == 3 and run["causal"] is True and run["synthetic"]["seq"] == 96
    q = run["recipes"][0]["q"]
    assert q["name"] == "nvfp4_1level" and q["element"] == {
        "kind": "FloatFormat",
        "name": "fp4_e2m1",
        "ebits": 2,
        "mbits": 1,
        "bias": 1,
        "signed": True,
        "subnormals": True,
        "specials": "none",
    }
    assert from_fields(AttentionRecipe, run["recipes"][0]) == F.get("fa4fp4_causal")
    assert config["inputs"]["kind"] == "synthetic"
    assert {"torch", "numpy", "pandas", "fp4lab", "python", "git_commit"} <= set(
        config["environment"]
    )


def test_attention_progress_bar_and_quiet(tmp_path, capsys):
    argv = ["attention", "--recipe", "nvfp4", *TINY]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    assert "nvfp4: forward and backward" in capsys.readouterr().err
    assert main([*argv, "--out", str(tmp_path / "b"), "--quiet"]) == 0
    assert capsys.readouterr().err == ""


def test_degenerate_results_say_why(tmp_path):
    argv = ["attention", "--recipe", "fp4_e2m1", "--recipe", "sageattn3", "--recipe", "attn_qat"]
    assert main([*argv, *TINY, "--out", str(tmp_path), "--quiet"]) == 0
    notes = pd.read_csv(tmp_path / "errors.csv", keep_default_na=False).set_index(
        ["recipe", "tensor"]
    )
    notes = notes["note"]
    assert notes["fp4_e2m1", "dv"] == "all zero: flushed entirely, do in dv (dv_do: fp4_e2m1)"
    assert "do in dp (dp_do: fp4_e2m1)" in notes["fp4_e2m1", "dq"]
    assert notes["fp4_e2m1", "o"] == ""
    for tensor in ("dq", "dk", "dv"):
        assert notes["sageattn3", tensor] == "high-precision backward against a quantized forward"
        assert notes["attn_qat", tensor] == ""  # its backward goes straight through the forward's


def test_attention_on_a_file_without_do_and_its_rerun(tmp_path, capsys):
    from fp4lab.analysis.inputs import save_inputs, synthetic_inputs

    x = synthetic_inputs(seq=64, heads=2, kv_heads=1, head_dim=32)
    path = save_inputs(tmp_path / "act.safetensors", x.q, x.k, x.v)
    out = tmp_path / "run"
    argv = ["--inputs", str(path), "--block-m", "32", "--block-n", "32", "--quiet"]
    assert main(["attention", "--recipe", "nvfp4", *argv, "--out", str(out)]) == 0
    assert "act.safetensors" in capsys.readouterr().out
    config = json.loads((out / "config.json").read_text())
    assert config["inputs"]["kind"] == "file" and len(config["inputs"]["sha256"]) == 64
    assert config["run"]["inputs_sha256"] == config["inputs"]["sha256"]
    assert "seed 0" in config["inputs"]["do"]
    assert list(pd.read_csv(out / "errors.csv")["recipe"]) == ["nvfp4"] * 4
    again = ["attention", "--config", str(out / "config.json"), "--quiet"]
    assert main([*again, "--out", str(tmp_path / "again")]) == 0
    assert (out / "errors.csv").read_bytes() == (tmp_path / "again" / "errors.csv").read_bytes()
    save_inputs(path, x.q, x.k, x.v + 1)  # the file changes: a rerun refuses it
    assert main([*again, "--out", str(tmp_path / "changed")]) == 2
    assert "changed since the run" in capsys.readouterr().err


def test_attention_default_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["attention", "--recipe", "exact", "--quiet", *SMALL]) == 0
    (folder,) = (tmp_path / "results").iterdir()
    assert folder.name.startswith("attention-") and (folder / "config.json").exists()


def test_attention_defaults_are_the_synthetic_input_s():
    args = build_parser().parse_args(["attention"])
    assert args.seq is None and args.inputs is None and args.batch_size is None
    from fp4lab.analysis import SyntheticConfig
    from fp4lab.cli import _run_from_args

    assert _run_from_args(args).synthetic == SyntheticConfig()


def test_config_files_that_do_not_parse_are_named(tmp_path, attention_run, capsys):
    _, out, _ = attention_run
    config = json.loads((out / "config.json").read_text())
    config["run"]["recipes"][1]["p"]["scale_rul"] = "ocp_floor"
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps(config))
    assert main(["attention", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    err = capsys.readouterr().err
    assert "run.recipes[1].p: QuantSpec has no field 'scale_rul'" in err and "scale_rule" in err
    del config["run"]["recipes"][1]["p"]["scale_rul"]
    config["run"]["recipes"][1]["p"]["arithmetic"] = "exactly"
    bad.write_text(json.dumps(config))
    assert main(["attention", "--config", str(bad), "--out", str(tmp_path / "r")]) == 2
    assert "run.recipes[1].p.arithmetic: 'exactly' is not a ScaleArithmetic value" in (
        capsys.readouterr().err
    )
    assert not (tmp_path / "r").exists()


# -- in a fresh process -------------------------------------------------------------------------
CUSTOM = """
import dataclasses

import fp4lab.formats as F
from fp4lab.recipes import FA4FP4_CAUSAL

E3M0 = F.register(F.FloatFormat(name="fp4_e3m0_test", ebits=3, mbits=0, bias=3))
F.register(dataclasses.replace(F.MXFP4, name="mxfp4_e3m0_test", element=E3M0))
F.register(dataclasses.replace(FA4FP4_CAUSAL, name="fa4fp4_e3m0v_test", v="mxfp4_e3m0_test"))
"""


def test_import_a_file_then_rerun_from_config_without_it(tmp_path):
    (tmp_path / "custom.py").write_text(CUSTOM)
    recipes = ["--recipe", "fa4fp4_e3m0v_test", "--recipe", "nvfp4_sr"]  # nvfp4_sr: seeded SR
    first = fp4lab(
        "attention",
        "--import",
        "custom.py",
        *recipes,
        "--causal",
        *SMALL,
        "--out",
        "a",
        "--quiet",
        cwd=tmp_path,
    )
    assert first.returncode == 0, first.stderr
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    v = config["run"]["recipes"][0]["v"]
    assert (
        v["name"] == "mxfp4_e3m0_test" and v["element"]["ebits"] == 3 and v["element"]["mbits"] == 0
    )
    assert config["imports"] == ["custom.py"]
    (tmp_path / "custom.py").unlink()  # the rerun cannot import it
    again = fp4lab("attention", "--config", "a/config.json", "--out", "b", "--quiet", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    for name in ("errors.csv", "trace.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert first.stdout.splitlines()[2:-1] == again.stdout.splitlines()[2:-1]


FAIL_FAST = """
import contextlib, io, json, os, sys
import fp4lab.analysis.compare, fp4lab.cli

def compute(*args, **kwargs):  # any compute at all ends the process with 99
    os._exit(99)

fp4lab.analysis.compare.attention = compute
fp4lab.cli.error_report = compute
results = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            code = fp4lab.cli.main(argv)
        except SystemExit as exit:
            code = exit.code
    results.append([code, err.getvalue()])
print(json.dumps(results))
"""


def test_every_argument_is_checked_before_any_compute(tmp_path):
    (tmp_path / "a-file").write_text("")
    (tmp_path / "config.json").write_text(json.dumps({"run": {"recipes": []}, "extra": 1}))
    run = ["attention", "--out", "r", *SMALL]
    cases = [
        ([*run, "--heatmap", "nosuch"], "--heatmap: 'nosuch' is not a per-tile statistic"),
        ([*run, "--heatmap", "q_tile"], "--heatmap: 'q_tile'"),
        ([*run, "--recipe", "nvfp5"], "--recipe: unknown attention recipe"),
        ([*run, "--head", "2"], "--head: 2 is not in the input"),
        ([*run, "--batch", "1"], "--batch: 1 is not in the input"),
        ([*run, "--head", "1", "--reduce", "max"], "--head: --reduce summarises every head"),
        ([*run, "--recipe", "nvfp4", "--recipe", "nvfp4"], "'nvfp4' is given twice"),
        (
            ["attention", "--out", "r", "--head-dim", "48", "--recipe", "fa3_fp8_paper"],
            "power of two",
        ),
        (["attention", "--out", "r", "--inputs", "nowhere.npz"], "nowhere.npz"),
        (["attention", "--out", "r", "--inputs", "x.npz", "--seq", "64"], "--seq: sizes come"),
        (["attention", "--out", "a-file", *SMALL], "--out: 'a-file' is a file"),
        (["attention", "--config", "missing.json"], "--config: no such file"),
        (["attention", "--config", "config.json", "--seed", "1"], "--seed: a rerun takes"),
        (["attention", "--config", "config.json"], "unknown entry 'extra'"),
        (["attention", "--seq", "0"], "argument --seq: must be a positive integer"),
        (["attention", "--import", "nowhere.py"], "--import nowhere.py: FileNotFoundError"),
        (["error", "--format", "nvfp5"], "--format: unknown block format 'nvfp5'"),
        (["error", "--axis", "3"], "--axis"),
        (["error", "--csv", "no/such/folder/e.csv"], "--csv"),
    ]
    result = subprocess.run(
        [sys.executable, "-c", FAIL_FAST, json.dumps([argv for argv, _ in cases])],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    assert result.returncode == 0, "a computation ran: " + result.stderr
    for (argv, message), (code, err) in zip(cases, json.loads(result.stdout), strict=True):
        assert code == 2 and message in err, (argv, err)
    assert not (tmp_path / "r").exists()  # no half-written results folder


def test_a_closed_pipe_ends_quietly(tmp_path):
    attention = ["attention", "--recipe", "nvfp4", *TINY, "--out", "r", "--quiet"]
    for argv in (["formats", "--markdown"], attention):
        read, write = os.pipe()
        os.close(read)  # the reader is gone before the first line is written
        done = subprocess.run(
            [sys.executable, "-m", "fp4lab", *argv],
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            cwd=tmp_path,
        )
        os.close(write)
        assert done.returncode == 0 and done.stderr == "", (argv, done.stderr)
    assert (tmp_path / "r" / "config.json").exists()  # the run still wrote its folder


TWO_RUNS = """
import contextlib, io, json, sys
import fp4lab.cli

printed = []
for argv in json.loads(sys.argv[1]):
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = fp4lab.cli.main(argv)
    printed.append([code, err.getvalue()])
print(json.dumps(printed))
"""


def test_a_recipe_run_with_the_other_mask_warns(tmp_path):
    run = [
        "attention",
        "--recipe",
        "fa4fp4_causal",
        "--recipe",
        "fa4fp4_directp",
        "--recipe",
        "nvfp4",
        *TINY,
        "--quiet",
    ]
    argv = [[*run, "--out", "a"], [*run, "--causal", "--out", "b"]]
    done = subprocess.run(
        [sys.executable, "-c", TWO_RUNS, json.dumps(argv)],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    (plain, plain_err), (causal, causal_err) = json.loads(done.stdout.splitlines()[-1])
    assert plain == causal == 0, done.stderr
    assert plain_err.splitlines() == [
        "fp4lab attention: warning: recipe 'fa4fp4_causal' was made for causal attention; this "
        "run is non-causal (add --causal to match)"
    ]
    assert causal_err.splitlines() == [
        "fp4lab attention: warning: recipe 'fa4fp4_directp' was made for non-causal attention; "
        "this run is causal (drop --causal to match)"
    ]


COLOUR_LIMITS = """
import json, sys
import matplotlib
matplotlib.use("Agg")
from fp4lab.analysis import plots
import fp4lab.cli

drawn = []
def record(draw):
    def wrapped(*args, **kwargs):
        fig = draw(*args, **kwargs)
        for ax in fig.axes:
            if ax.collections and ax.get_label() != "<colorbar>":
                norm = ax.collections[0].norm
                drawn.append([draw.__name__, ax.get_title(), norm.vmin, norm.vmax])
        bars = [ax.get_ylabel() for ax in fig.axes if ax.get_label() == "<colorbar>"]
        drawn.append([draw.__name__, "colour bar", bars[0], None])
        return fig
    return wrapped

plots.product_heatmaps = record(plots.product_heatmaps)
plots.comparison_heatmaps = record(plots.comparison_heatmaps)
code = fp4lab.cli.main(sys.argv[1:])
print(json.dumps([code, drawn]))
"""


def test_heatmaps_of_one_run_share_one_colour_scale(tmp_path):
    recipes = ["--recipe", "nvfp4", "--recipe", "fa4fp4_causal", "--recipe", "mxfp4"]
    result = subprocess.run(
        [
            sys.executable,
            "-c",
            COLOUR_LIMITS,
            "attention",
            *recipes,
            "--causal",
            *SMALL,
            "--reduce",
            "max",
            "--out",
            "r",
            "--quiet",
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
    )
    code, drawn = json.loads(result.stdout.splitlines()[-1])
    assert code == 0, result.stderr
    panels = [d for d in drawn if d[1] != "colour bar"]
    assert len(panels) == 3 * 6 + 3 * 6  # one figure per recipe and the combined one
    assert len({(vmin, vmax) for _, _, vmin, vmax in panels}) == 1
    labels = {label for _, title, label, _ in drawn if title == "colour bar"}
    assert labels == {"relative error of the product tile\n(prod_err, max over batch and heads)"}
    assert sorted(os.listdir(tmp_path / "r")) == [
        "config.json",
        "errors.csv",
        "heatmap-fa4fp4_causal.png",
        "heatmap-mxfp4.png",
        "heatmap-nvfp4.png",
        "heatmaps.png",
        "saturation.csv",
        "trace.parquet",
    ]


def test_the_readme_shell_tour_runs(tmp_path):
    """The README's --import and --config example, run as written."""
    readme = (ROOT / "README.md").read_text()
    (block,) = re.findall(r"```shell\n(.*?)```", readme, flags=re.S)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    done = subprocess.run(
        ["bash", "-euo", "pipefail", "-c", block],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    assert "identical" in done.stdout


def test_study_commands_are_fp4labs_own(capsys, tmp_path):
    parser = build_parser()
    options = {o for p, a in _actions(parser) if p == "fp4lab study run" for o in a.option_strings}
    assert {"--import", "--preset", "--set", "--resume", "--backend"} <= options
    assert main(["study", "list"]) == 0
    assert "quantizer-error:" in capsys.readouterr().out
    assert main(["study", "run", "no-such-study", "--out", str(tmp_path / "x")]) == 2
    assert "unknown study 'no-such-study'" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()


def test_study_run_nproc_is_checked_and_rebuilt_for_torchrun(capsys, monkeypatch):
    """--nproc 0 is refused by name; under torchrun a --nproc other than its ranks is too;
    --nproc 2 relaunches the same command under torch.distributed.run without --nproc (its
    2-rank run is tests/studies/test_pv_divergence.py's gloo test)."""
    from fp4lab.studies import cli as study_cli

    assert main(["study", "run", "pv-divergence", "--nproc", "0"]) == 2
    assert "--nproc must be >= 1, got 0" in capsys.readouterr().err
    monkeypatch.setenv("WORLD_SIZE", "4")
    assert main(["study", "run", "pv-divergence", "--nproc", "2"]) == 2
    assert "already runs under torchrun with 4 ranks" in capsys.readouterr().err
    monkeypatch.delenv("WORLD_SIZE")
    launched = []
    monkeypatch.setattr(study_cli.subprocess, "run",
                        lambda command, check: launched.append(command) or
                        subprocess.CompletedProcess(command, 3))
    assert main(["study", "run", "pv-divergence", "--nproc", "2", "--set", "steps=4",
                 "--resume", "--out", "o"]) == 3
    assert launched[0][1:6] == ["-m", "torch.distributed.run", "--standalone",
                                "--nproc_per_node", "2"]
    assert launched[0][6:] == ["-m", "fp4lab", "study", "run", "pv-divergence", "--preset",
                               "smoke", "--set", "steps=4", "--out", "o", "--device", "cpu",
                               "--backend", "reference", "--seed", "0", "--resume"]
