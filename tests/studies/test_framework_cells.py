"""The framework's data-parallel cells, scratch folders and extra presets, on a toy study
(tests/studies/toy_steps/): a checkpointing cell killed mid-way resumes from its
scratch folder, the folder goes once the cell is stored, and two gloo ranks run each cell
together."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

from fp4lab.studies import load_study, run_study

TOY = Path(__file__).resolve().parent / "toy_steps"
ROOT = Path(__file__).resolve().parents[2]


def run_steps(out: Path, preset: str = "smoke", **options) -> pd.DataFrame:
    run_study("toy-steps", preset, out=out, folder=TOY, quiet=True, **options)
    return pd.read_parquet(out / "metrics.parquet")


@pytest.fixture
def module():
    found = load_study("toy-steps", TOY).module
    found.STEPS_TAKEN.clear()
    return found


def test_a_third_preset_runs_and_an_unknown_one_names_them_all(tmp_path, module):
    table = run_steps(tmp_path / "long", preset="long")
    assert len(module.STEPS_TAKEN) == 2 * 5 and len(table) == 2
    with pytest.raises(ValueError, match="preset must be one of smoke, full, long, got 'x'"):
        run_steps(tmp_path / "x", preset="x")


def test_a_cell_killed_mid_way_resumes_from_its_scratch_checkpoint(tmp_path, module,
                                                                   monkeypatch):
    whole = run_steps(tmp_path / "whole")
    assert not (tmp_path / "whole" / "scratch").exists()  # deleted once every cell is stored

    def interrupt(cell, step):
        if (cell, step) == (1, 2):
            raise KeyboardInterrupt

    monkeypatch.setattr(module, "after_step", interrupt)
    with pytest.raises(KeyboardInterrupt):
        run_steps(tmp_path / "cut")
    cut = tmp_path / "cut"
    assert sorted(p.name for p in (cut / "cells").iterdir()) == ["00000.json"]
    assert not (cut / "scratch" / "00000").exists()  # cell 0 stored: its scratch deleted
    assert json.loads((cut / "scratch" / "00001" / "state.json").read_text())["step"] == 2
    monkeypatch.setattr(module, "after_step", lambda cell, step: None)
    module.STEPS_TAKEN.clear()
    resumed = run_steps(cut, resume=True)
    assert module.STEPS_TAKEN == [(1, 3)]  # only the step after the checkpoint
    assert resumed["resumed_at"].tolist() == [0, 2]
    pd.testing.assert_frame_equal(resumed.drop(columns="resumed_at"),
                                  whole.drop(columns="resumed_at"))


def test_a_run_killed_in_its_first_cell_leaves_only_scratch_which_resume_continues(
        tmp_path, module, monkeypatch):
    whole = run_steps(tmp_path / "whole")
    monkeypatch.setattr(module, "after_step", lambda cell, step: (_ for _ in ()).throw(
        KeyboardInterrupt) if (cell, step) == (0, 1) else None)
    out = tmp_path / "cut"
    with pytest.raises(KeyboardInterrupt):
        run_steps(out)
    assert [p.name for p in out.iterdir()] == ["scratch"]
    with pytest.raises(ValueError, match="scratch files of a run killed in its first cell"):
        run_steps(out)
    monkeypatch.setattr(module, "after_step", lambda cell, step: None)
    resumed = run_steps(out, resume=True)
    assert resumed["resumed_at"].tolist() == [1, 0]
    pd.testing.assert_frame_equal(resumed.drop(columns="resumed_at"),
                                  whole.drop(columns="resumed_at"))


def test_two_gloo_ranks_run_each_data_parallel_cell_together(tmp_path, module):
    one = run_steps(tmp_path / "one")
    script = tmp_path / "launch.py"
    script.write_text(
        "import sys\nfrom fp4lab.studies import run_study\n"
        f"run_study('toy-steps', 'smoke', out=sys.argv[1], folder={str(TOY)!r}, quiet=True)\n"
    )
    torchrun = Path(sys.executable).with_name("torchrun")
    subprocess.run(
        [str(torchrun), "--standalone", "--nproc_per_node", "2", str(script),
         str(tmp_path / "two")],
        cwd=ROOT, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True,
        timeout=120,
    )
    two = pd.read_parquet(tmp_path / "two" / "metrics.parquet")
    assert two["world"].tolist() == [2, 2]
    # rank r adds r + 1 + c: the all_reduced sum over two ranks is 3 + 2c where one rank has 1 + c
    c = one["cell_seed"] % 7
    expected = (3 + 2 * c) * (1 + 2 + 3)
    assert two["total"].tolist() == expected.astype(float).tolist()
    assert one["total"].tolist() == ((1 + c) * 6).astype(float).tolist()
