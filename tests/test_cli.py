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
