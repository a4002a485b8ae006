"""The README's promises: its commands are what CI runs, and its tour runs as written."""

import re
import shlex
import time
from pathlib import Path

import torch

import fp4lab.formats as F

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def code_blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def test_ci_runs_the_readme_commands():
    ci = (ROOT / ".ci" / "run").read_text()
    commands = [
        line for block in code_blocks("bash") for line in block.splitlines() if line.strip()
    ]
    assert len(commands) == 2, "the README gives exactly two set-up commands"
    for command in commands:
        assert command in ci


def test_the_tours_run():
    tours = code_blocks("python")
    assert len(tours) == 2, "the README has a formats tour and an attention tour"
    try:
        for tour in tours:
            exec(compile(tour, "README.md", "exec"), {})
    finally:
        F.unregister("mxfp4_rht16")


def test_the_recipes_table_is_the_registry_s():
    from fp4lab.formats.tables import to_markdown
    from fp4lab.recipes.tables import recipes_frame

    table = to_markdown(recipes_frame(products=False)[["name", "summary", "mask"]])
    assert table in README, "regenerate the README's recipes table from recipes_frame"


def test_the_main_command_prints_the_ranking_in_under_a_minute(tmp_path, monkeypatch, capsys):
    """The set-up line ends in the command a newcomer runs first: the smoke preset of
    mxfp4-pv-mechanisms, printing its ranking and writing its results folder."""
    from fp4lab.cli import main

    line = code_blocks("bash")[0].strip().splitlines()[0]
    argv = shlex.split(line.split("&& .venv/bin/fp4lab ")[-1])
    assert argv == ["study", "run", "mxfp4-pv-mechanisms"]
    monkeypatch.chdir(tmp_path)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared 2-core machine's fair share
    try:
        start = time.monotonic()
        assert main([*argv, "--quiet"]) == 0
        seconds = time.monotonic() - start
    finally:
        torch.set_num_threads(threads)
    printed = capsys.readouterr().out
    assert "| rank | mechanism |" in printed and "Named for the training study" in printed
    (folder,) = (tmp_path / "results").glob("mxfp4-pv-mechanisms-smoke-*")
    assert (folder / "ranking.csv").is_file() and (folder / "report.md").is_file()
    assert seconds < 60, f"the main command took {seconds:.0f} s"
