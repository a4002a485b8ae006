"""The study framework on a toy study (tests/studies/toy): configs from strings and JSON,
the results folder, reruns, resumption after a kill, two gloo ranks, backends, the CLI."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import pandas as pd
import pytest

import fp4lab.studies.discovery as discovery
from fp4lab.config import from_fields, to_fields
from fp4lab.studies import apply_overrides, load_study, rebuild_report, run_study, summary
from fp4lab.studies.cli import add_study_commands

TOY = Path(__file__).resolve().parent / "toy"
ROOT = Path(__file__).resolve().parents[2]
FILES = ("config.json", "environment.json", "metrics.parquet", "metrics.csv", "report.md")


def run_toy(out: Path, *overrides: str, **options) -> pd.DataFrame:
    options.setdefault("quiet", True)
    preset = options.pop("preset", "smoke")
    run_study("toy-sweep", preset, list(overrides), out=out, folder=TOY, **options)
    return pd.read_parquet(out / "metrics.parquet")


@dataclass(frozen=True)
class Every:
    n: int = 1
    x: float = 0.5
    flag: bool = False
    word: str = "a"
    choice: Literal["one", "two"] = "one"
    items: tuple[float, ...] = (1.0,)
    names: tuple[str, ...] = ()
    maybe: int | None = None


# -- configs -------------------------------------------------------------------------------


def test_overrides_are_parsed_into_each_fields_type():
    got = apply_overrides(
        Every(),
        ["n=3", "x=1e-3", "flag=yes", "word=b=c", "choice=two", "items=1, 2.5,inf", "names=",
         "maybe=none"],
    )
    assert got == Every(3, 1e-3, True, "b=c", "two", (1.0, 2.5, math.inf), (), None)
    assert apply_overrides(Every(), ["maybe=7"]).maybe == 7


@pytest.mark.parametrize(
    "entry, words",
    [
        ("m=1", "unknown key 'm'"),
        ("n=1.5", "n takes a int"),
        ("x=abc", "x takes a float"),
        ("flag=maybe", "flag takes a bool"),
        ("choice=three", "choice takes a one of one, two"),
        ("items=1,x", "items takes a comma-separated list of float"),
        ("n", "expected key=value"),
    ],
    ids=["unknown", "int", "float", "bool", "literal", "list", "no-equals"],
)
def test_bad_overrides_name_the_key(entry, words):
    with pytest.raises(ValueError, match=words):
        apply_overrides(Every(), [entry])


def test_a_field_named_kind_is_refused():
    @dataclass(frozen=True)
    class Clash:
        kind: str = "a"

    with pytest.raises(TypeError, match="fp4lab.config's tag"):
        apply_overrides(Clash(), [])


def test_config_json_round_trip_without_code():
    """config.json holds fp4lab.config's fields; they read back without evaluating code."""
    config = Every(2, -math.inf, True, "z", "two", (0.25, math.nan), ("p", "q"), 4)
    text = json.dumps(to_fields(config))
    back = from_fields(Every, json.loads(text))
    assert back.items[1] != back.items[1] and back.items[:1] == (0.25,) and back.x == -math.inf
    assert back.names == ("p", "q") and back.maybe == 4
    with pytest.raises(ValueError, match="config.n: must be an integer"):
        from_fields(Every, {"n": "2"})


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["cellz=3"], "unknown key 'cellz'"),
        (["cells=three"], "cells takes a int"),
        (["cells=0"], "cells must be >= 1"),  # the config's own check
        (["draw=normal"], "draw takes a one of gauss, uniform"),
    ],
    ids=["unknown-key", "wrong-type", "config-check", "bad-choice"],
)
def test_bad_set_fails_before_anything_runs(tmp_path, overrides, words):
    out = tmp_path / "run"
    with pytest.raises(ValueError, match=words):
        run_toy(out, *overrides)
    assert not out.exists()


def test_bad_arguments_fail_before_anything_runs(tmp_path):
    out = tmp_path / "run"
    for options, words in (
        ({"device": "tpu"}, "device must be"),
        ({"backend": "cuda"}, "backend must be one of"),
        ({"seed": -1}, "seed must be"),
        ({"preset": "medium"}, "preset must be one of"),
    ):
        with pytest.raises(ValueError, match=words):
            run_toy(out, **options)
    with pytest.raises(ValueError, match="unknown study 'nope'; known: toy-sweep"):
        run_study("nope", folder=TOY)
    assert not out.exists()


def test_triton_backend_raises_the_librarys_error_and_never_falls_back(tmp_path):
    """The toy's fp4lab.attention call gets backend='triton' as given: the library refuses
    float32 CPU tensors (or a missing triton) at the first cell, and nothing is written."""
    with pytest.raises((NotImplementedError, ValueError), match="[Tt]riton"):
        run_toy(tmp_path / "run", backend="triton")
    assert not (tmp_path / "run").exists()


# -- the results folder ----------------------------------------------------------------------


def test_results_folder_holds_every_file(tmp_path):
    metrics = run_toy(tmp_path / "run")
    for name in FILES:
        assert (tmp_path / "run" / name).is_file(), name
    assert (tmp_path / "run" / "figures" / "values.png").stat().st_size > 0
    assert sorted(p.name for p in (tmp_path / "run" / "cells").iterdir()) == [
        f"0000{i}.json" for i in range(4)
    ]
    assert list(metrics.columns[:4]) == ["cell", "i", "parity", "cell_seed"]
    assert len(metrics) == 8 and metrics["value"].notna().all()
    config = json.loads((tmp_path / "run" / "config.json").read_text())
    assert config["study"] == "toy-sweep" and config["config"]["cells"] == 4
    env = json.loads((tmp_path / "run" / "environment.json").read_text())["sessions"][0]
    assert {"fp4lab", "git_commit", "torch", "device", "seed"} <= set(env)
    assert pd.read_csv(tmp_path / "run" / "metrics.csv")["value"].tolist() == pytest.approx(
        metrics["value"].tolist(), rel=1e-12
    )
    assert not list((tmp_path / "run").rglob(".*.tmp"))


def test_cells_may_return_more_tables(tmp_path):
    metrics = run_toy(tmp_path / "run", "extra=true")
    tiles = pd.read_parquet(tmp_path / "run" / "tiles.parquet")
    assert len(tiles) == 2 * 4 and list(tiles.columns) == ["cell", "i", "parity", "cell_seed",
                                                            "tile", "norm"]
    assert set(tiles["cell_seed"]) == set(metrics["cell_seed"])


def test_a_report_may_derive_tables_stored_as_parquet_and_csv(tmp_path, monkeypatch):
    metrics = run_toy(tmp_path / "run")
    want = metrics.groupby("parity", as_index=False)["value"].sum()
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "run" / "by_parity.parquet"), want)
    assert pd.read_csv(tmp_path / "run" / "by_parity.csv")["value"].tolist() == pytest.approx(
        want["value"].tolist(), rel=1e-12)
    (tmp_path / "run" / "by_parity.csv").unlink()
    rebuild_report(tmp_path / "run", folder=TOY)
    assert (tmp_path / "run" / "by_parity.csv").is_file()
    module = load_study("toy-sweep", TOY).module
    monkeypatch.setattr(module, "report", lambda config, metrics: ("", {}, {"tiles": metrics}))
    with pytest.raises(ValueError, match="the report's table 'tiles' has the name of a table"):
        run_toy(tmp_path / "clash", "extra=true")
    monkeypatch.setattr(module, "report", lambda config, metrics: ("", {}, {"Bad": metrics}))
    with pytest.raises(ValueError, match="the report's table 'Bad' must be a DataFrame"):
        rebuild_report(tmp_path / "run", folder=TOY)


def test_summary_is_the_what_the_numbers_show_section():
    report = "# S\n\n## Setup\n\nx\n\n## What the numbers show\n\n- a\n- b\n\n## Rest\n\ny\n"
    assert summary(report) == "- a\n- b"
    assert summary("## What the numbers show\n\nlast\n") == "last"
    assert summary("## Setup\n\nx\n") is None


def test_rerun_with_the_same_seed_gives_identical_metrics(tmp_path):
    first = run_toy(tmp_path / "a", seed=3)
    again = run_toy(tmp_path / "b", seed=3)
    other = run_toy(tmp_path / "c", seed=4)
    pd.testing.assert_frame_equal(first, again)
    assert not first["value"].equals(other["value"])


def test_an_existing_run_is_not_overwritten_and_resume_checks_the_config(tmp_path):
    run_toy(tmp_path / "run")
    with pytest.raises(ValueError, match="holds a run already; pass --resume"):
        run_toy(tmp_path / "run")
    with pytest.raises(ValueError, match=r"different config \(scales=\[0.5, 2.0\]\)"):
        run_toy(tmp_path / "run", "scales=1", resume=True)
    with pytest.raises(ValueError, match="was run with seed=0, not 1"):
        run_toy(tmp_path / "run", seed=1, resume=True)


def test_report_is_rebuilt_from_the_stored_metrics(tmp_path):
    run_toy(tmp_path / "run")
    report = (tmp_path / "run" / "report.md").read_text()
    (tmp_path / "run" / "report.md").unlink()
    (tmp_path / "run" / "figures" / "values.png").unlink()
    (tmp_path / "run" / "cells" / "00000.json").unlink()  # not read: nothing is recomputed
    assert rebuild_report(tmp_path / "run", folder=TOY).read_text() == report
    assert (tmp_path / "run" / "figures" / "values.png").exists()


# -- interrupted runs ------------------------------------------------------------------------


def test_a_run_that_fails_after_k_cells_resumes_to_the_same_table(tmp_path, monkeypatch):
    whole = run_toy(tmp_path / "whole", "cells=6")
    module = load_study("toy-sweep", TOY).module
    real, calls = module.run_cell, []

    def dies_at_the_fourth(config, cell, ctx):
        calls.append(cell["i"])
        if len(calls) == 4:
            raise KeyboardInterrupt  # as a Ctrl-C or a kill would, mid-sweep
        return real(config, cell, ctx)

    monkeypatch.setattr(module, "run_cell", dies_at_the_fourth)
    with pytest.raises(KeyboardInterrupt):
        run_toy(tmp_path / "cut", "cells=6")
    assert len(list((tmp_path / "cut" / "cells").glob("*.json"))) == 3
    assert not (tmp_path / "cut" / "metrics.parquet").exists()
    (tmp_path / "cut" / "cells" / ".00003.json.x.tmp").write_text("{half")  # a torn write
    monkeypatch.setattr(module, "run_cell", real)
    calls.clear()
    resumed = run_toy(tmp_path / "cut", "cells=6", resume=True)
    pd.testing.assert_frame_equal(resumed, whole)
    sessions = json.loads((tmp_path / "cut" / "environment.json").read_text())["sessions"]
    assert [s["cells_done_before"] for s in sessions] == [0, 3]


def _command(out: Path, *extra: str) -> list[str]:
    code = (
        "import sys; from fp4lab.studies import run_study; "
        f"run_study('toy-sweep', 'full', sys.argv[2:], out=sys.argv[1], folder={str(TOY)!r}, "
        "quiet=True, resume=True)"
    )
    return [sys.executable, "-c", code, str(out), *extra]


def test_a_killed_process_resumes_to_the_same_table(tmp_path):
    """SIGKILL while cells are running (some stored, one in flight), then --resume."""
    whole = run_toy(tmp_path / "whole", "cells=8")
    out = tmp_path / "killed"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(_command(out, "cells=8", "pause=0.4"), cwd=ROOT, env=env)
    deadline = time.monotonic() + 60
    while len(list((out / "cells").glob("0*.json"))) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    stored = len(list((out / "cells").glob("0*.json")))
    assert 3 <= stored < 8 and not (out / "metrics.parquet").exists()
    subprocess.run(_command(out, "cells=8", "pause=0.4"), cwd=ROOT, check=True, timeout=120,
                   env=env)
    resumed = pd.read_parquet(out / "metrics.parquet")
    pd.testing.assert_frame_equal(resumed.drop(columns="cell"), whole.drop(columns="cell"))
    assert resumed["cell"].tolist() == whole["cell"].tolist()


def test_two_gloo_ranks_give_the_table_of_one_process(tmp_path):
    """torchrun --nproc_per_node 2 on the CPU: cells round-robin, rank 0 writes the folder."""
    one = run_toy(tmp_path / "one", "cells=5")
    torchrun = Path(sys.executable).with_name("torchrun")
    code = _command(tmp_path / "two", "cells=5")[2]
    script = tmp_path / "launch.py"
    script.write_text(code.replace("; ", "\n"))
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script),
         str(tmp_path / "two"), "cells=5"],
        cwd=ROOT, check=True, env=env, capture_output=True, timeout=120,
    )
    two = pd.read_parquet(tmp_path / "two" / "metrics.parquet")
    pd.testing.assert_frame_equal(two, one)
    env = json.loads((tmp_path / "two" / "environment.json").read_text())["sessions"][0]
    assert env["world_size"] == 2


TOY_RANKS = Path(__file__).resolve().parent / "toy_ranks"


def run_two_ranks(out: Path, *overrides: str, first_report: float = 60.0):
    """toy-ranks under torchrun with 2 gloo ranks (importing this tree's fp4lab), `_watch`'s
    first report after `first_report` seconds; the finished process (its stderr holds every
    rank's)."""
    script = out.with_name(f"{out.name}-launch.py")
    script.write_text(
        "import sys\nimport fp4lab.studies.runner as runner\n"
        f"runner._FIRST_REPORT_S = {first_report}\n"
        f"runner.run_study('toy-ranks', 'smoke', sys.argv[1:], out={str(out)!r}, "
        f"folder={str(TOY_RANKS)!r}, quiet=True)\n"
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    return subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script), *overrides],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)},
        capture_output=True, text=True, timeout=120,
    )


def test_a_slow_rank_and_the_rank_waiting_for_it_say_so_and_name_the_cell(tmp_path):
    """Cell 1 (rank 1) sleeps 3 s with reports after 0.5, 1, 2 s: rank 1 names its cell and
    the line it is at, rank 0 the cell it waits for (it started waiting no later than rank 1
    started the cell); the results are those of a quick run, which says nothing."""
    done = run_two_ranks(tmp_path / "slow", "slow=1", "pause=3", first_report=0.5)
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stderr.splitlines()
    running = [x for x in lines if x.startswith("toy-ranks: rank 1 has run cell 1 (i=1) for")]
    waiting = [x for x in lines if x.startswith(
        "toy-ranks: rank 0 has waited in the gather for the round's other ranks (cell 1 on "
        "rank 1) for")]
    assert len(running) == 3 and len(waiting) >= 3, done.stderr[-3000:]
    assert running[0].endswith("s (at toy_ranks.py:38 in run_cell)"), running[0]
    quick = run_two_ranks(tmp_path / "quick")
    assert quick.returncode == 0 and "toy-ranks: rank" not in quick.stderr
    pd.testing.assert_frame_equal(pd.read_parquet(tmp_path / "slow" / "metrics.parquet"),
                                  pd.read_parquet(tmp_path / "quick" / "metrics.parquet"))


def test_an_error_that_does_not_unpickle_still_names_its_cell_on_every_rank(tmp_path):
    """Cell 1 raises an error that pickles but does not unpickle: rank 1 raises it, rank 0
    says cell 1 failed with its traceback (the gather carries the text, not the error)."""
    done = run_two_ranks(tmp_path / "fail", "fail=1")
    assert done.returncode != 0
    error = "fp4lab_study_toy_ranks.KeywordError: the widget broke"
    assert f"[rank1]: {error}" in done.stderr, done.stderr[-3000:]
    assert "[rank0]: RuntimeError: cell 1 failed on another rank:" in done.stderr
    assert f"[rank0]: {error}" in done.stderr
    assert "takes 1 positional argument" not in done.stderr


# -- the command line ------------------------------------------------------------------------


@pytest.fixture
def cli(monkeypatch):
    """A parser of our own with the study commands, reading the toy studies."""
    monkeypatch.setattr(discovery, "studies_dir", lambda: TOY)
    parser = argparse.ArgumentParser(prog="fp4lab")
    add_study_commands(parser.add_subparsers(dest="command", required=True))

    def call(*argv: str) -> int:
        args = parser.parse_args(argv)
        return args.run(args)

    call.parser = parser
    return call


def test_cli_lists_runs_and_rebuilds(cli, tmp_path, capsys):
    assert cli("study", "list", "--config") == 0
    out = capsys.readouterr().out
    assert "toy-sweep: Does the framework" in out
    assert "scales (comma-separated list of float): smoke (0.5, 2.0), full (0.5, 2.0)" in out
    run = tmp_path / "run"
    assert cli("study", "run", "toy-sweep", "--set", "cells=2", "--set", "size=8", "--out",
               str(run), "--seed", "5", "--quiet") == 0
    printed = capsys.readouterr().out
    assert f"Wrote {run}" in printed
    assert "What the numbers show:\n\n4 rows, sum of values" in printed  # the summary
    assert "Nothing." not in printed
    config = json.loads((run / "config.json").read_text())
    assert config["overrides"] == ["cells=2", "size=8"] and config["seed"] == 5
    assert "--set cells=2 --set size=8 --seed 5" in (run / "report.md").read_text()
    assert cli("study", "report", str(run)) == 0
    with pytest.raises(ValueError, match="unknown key 'sise'"):
        cli("study", "run", "toy-sweep", "--set", "sise=8", "--out", str(tmp_path / "x"))


def test_every_cli_option_has_help(cli):
    def parsers(parser):
        yield parser
        for action in parser._actions:  # argparse keeps its subparsers here
            if isinstance(action, argparse._SubParsersAction):
                for child in action.choices.values():
                    yield from parsers(child)

    for parser in parsers(cli.parser):
        for action in parser._actions:
            if not isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
                assert action.help, f"{parser.prog} {action.dest} has no help"


def test_the_reproduce_section_says_what_a_rerun_repeats_on_each_device():
    # the CPU's bit-for-bit repeat is tested; a GPU's is not promised (two H200 runs parted
    # at step 1-3), so the report must not say it is
    from fp4lab.studies.runner import _determinism

    assert "same seed gives the same numbers (tested)" in _determinism("cpu")
    for device in ("cuda", "cuda:1"):
        words = _determinism(device)
        assert "need not repeat" in words and "same numbers (tested)" not in words
