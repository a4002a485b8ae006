"""The studies' smoke runs, once per test session (tests of a study and the notebook share
them), with one torch thread: on a shared 2-core machine two intra-op threads make the
simulation several times slower (the numbers do not depend on it)."""

import pytest
import torch

from fp4lab.studies import run_study


@pytest.fixture(scope="package", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


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


@pytest.fixture(scope="session")
def scale_range_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "scale-range")


@pytest.fixture(scope="session")
def causal_leakage_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "causal-leakage")


@pytest.fixture(scope="session")
def mxfp4_pv_mechanisms_smoke(tmp_path_factory):
    return _smoke(tmp_path_factory, "mxfp4-pv-mechanisms")
