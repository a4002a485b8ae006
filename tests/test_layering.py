"""The import rules of DESIGN.md, checked on the source: formats imports nothing else of fp4lab,
recipes only formats, analysis and kernels formats and recipes (never each other)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "fp4lab"
ALLOWED = {
    "formats": {"formats"},
    "recipes": {"formats", "recipes"},
    "analysis": {"formats", "recipes", "analysis"},
    "kernels": {"formats", "recipes", "kernels"},
}


def fp4lab_imports(path: Path) -> set[str]:
    """The fp4lab subpackages a module imports (``fp4lab.x.y`` -> ``x``)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [node.module]
        for name in names:
            parts = name.split(".")
            if parts[0] == "fp4lab":
                found.add(parts[1] if len(parts) > 1 else "<fp4lab>")
    return found


@pytest.mark.parametrize("layer", sorted(ALLOWED))
def test_each_layer_imports_only_what_it_may(layer):
    modules = sorted((PACKAGE / layer).glob("*.py"))
    assert modules, f"no modules in fp4lab/{layer}"
    for path in modules:
        bad = fp4lab_imports(path) - ALLOWED[layer]
        assert not bad, (
            f"fp4lab/{layer}/{path.name} imports {sorted(bad)}; {layer} may import "
            f"{sorted(ALLOWED[layer])}"
        )


def test_the_rule_checker_sees_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text(
        "import fp4lab.analysis.flash\nfrom fp4lab.kernels import x\nfrom . import y\n"
    )
    assert fp4lab_imports(module) == {"analysis", "kernels"}
