"""The README's promises: its commands are what CI runs, and its tour runs as written."""

import re
from pathlib import Path

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
