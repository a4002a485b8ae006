"""Studies: reproducible experiments on what quantization does inside attention.

What. A study answers one question with one command whose results anyone can rerun:
``fp4lab study run quantizer-error --preset smoke`` writes a results folder holding the
resolved config, the environment (fp4lab version and commit, torch, device, seeds), a
metrics table (Parquet and CSV), figures (PNG) and a report that states the question, the
setup, the numbers and what they show, generated from the metrics.

How. A study is a module in the repository's ``studies/`` folder (`discovery` lists what it
defines): a typed config dataclass with ``smoke`` and ``full`` presets, the cells of its
sweep, a function running one cell and one writing the report from the metrics. The
framework does the rest, the same way for every study (`runner`): it parses and checks
``--set key=value`` overrides before anything runs (`config`), spreads the cells over the
ranks of ``torchrun``, stores every finished cell in its own file so that ``--resume``
finishes a killed run with the same table an uninterrupted one gives, derives every cell's
seed from the run's seed and the cell's parameters, and writes each file atomically
(`folder`). ``fp4lab study report DIR`` (`rebuild_report`) redraws the report and figures
from the stored metrics without computing anything.

Why a framework and not scripts. Resumption, ranks, seeds and the results folder are the
parts every study gets wrong alone; written once here they are tested once
(tests/studies/), and a study module is left with its question.
"""

from fp4lab.studies.config import apply_overrides
from fp4lab.studies.discovery import CellContext, Study, list_studies, load_study, studies_dir
from fp4lab.studies.folder import Results, atomic_write, open_results
from fp4lab.studies.inputs import describe_inputs, resolve_inputs, study_inputs
from fp4lab.studies.runner import cell_seed, rebuild_report, run_study
from fp4lab.studies.text import SUMMARY_HEADING, markdown_table, number, summary

__all__ = [
    "CellContext",
    "Study",
    "list_studies",
    "load_study",
    "studies_dir",
    "run_study",
    "rebuild_report",
    "cell_seed",
    "Results",
    "open_results",
    "atomic_write",
    "apply_overrides",
    "markdown_table",
    "number",
    "summary",
    "SUMMARY_HEADING",
    "resolve_inputs",
    "study_inputs",
    "describe_inputs",
]
