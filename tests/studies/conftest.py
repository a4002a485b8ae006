"""The studies' smoke runs, once per test session (tests of a study and the notebook share
them)."""

import pytest

from fp4lab.studies import run_study


def _smoke(factory, name: str):
    out = factory.mktemp(name) / "smoke"
    run_study(name, "smoke", out=out, quiet=True)
    return out


@pytest.fixture(scope="session")
def quantizer_error_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "quantizer-error")


@pytest.fixture(scope="session")
def p_operand_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "p-operand")


@pytest.fixture(scope="session")
def attention_gradients_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "attention-gradients")
