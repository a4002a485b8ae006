"""fp4lab.studies.inputs: a study's inputs from the synthetic model or a saved file, with the
file's hash recorded and checked."""

from __future__ import annotations

import pytest
import torch

from fp4lab.analysis import save_inputs, synthetic_inputs
from fp4lab.studies import describe_inputs, resolve_inputs, study_inputs

SIZES = dict(batch=1, heads=2, seq=32, head_dim=16)


@pytest.fixture
def saved(tmp_path):
    x = synthetic_inputs(seed=7, **SIZES)
    return save_inputs(tmp_path / "acts.npz", x.q, x.k, x.v, x.do), x


def test_without_a_file_the_synthetic_model(saved):
    assert resolve_inputs(None, None) == (None, None)
    x = study_inputs(None, 7, **SIZES)
    assert torch.equal(x.q, saved[1].q) and x.source == "synthetic"
    assert "synthetic model" in describe_inputs(None, None, **SIZES)


def test_a_file_is_made_absolute_and_hashed(saved, monkeypatch):
    path, x = saved
    monkeypatch.chdir(path.parent)
    resolved, sha = resolve_inputs("acts.npz", None)
    assert resolved == str(path.resolve()) and len(sha) == 64
    assert resolve_inputs(resolved, sha) == (resolved, sha)
    got = study_inputs(resolved, 0)
    assert torch.equal(got.v, x.v) and torch.equal(got.do, x.do)
    assert sha in describe_inputs(resolved, sha)


def test_a_file_without_do_gets_one_drawn_from_the_seed(tmp_path):
    x = synthetic_inputs(seed=1, **SIZES)
    path = save_inputs(tmp_path / "no_do.npz", x.q, x.k, x.v)
    a, b = study_inputs(str(path), 3), study_inputs(str(path), 3)
    assert a.do.shape == x.q.shape and torch.equal(a.do, b.do)


def test_a_changed_file_missing_file_or_stray_hash_is_refused(saved, tmp_path):
    path, x = saved
    with pytest.raises(ValueError, match="inputs_sha256: the file .* has sha256"):
        resolve_inputs(str(path), "0" * 64)
    with pytest.raises(ValueError, match="inputs: no such file"):
        resolve_inputs(str(tmp_path / "gone.npz"), None)
    with pytest.raises(ValueError, match="inputs_sha256 is the hash of an inputs file"):
        resolve_inputs(None, "0" * 64)
    (tmp_path / "bad.npz").write_text("not an archive")
    with pytest.raises(ValueError, match="not a readable .npz archive"):
        resolve_inputs(str(tmp_path / "bad.npz"), None)


def test_a_recorded_run_reads_back_without_its_file(tmp_path):
    """Rebuilding a report rebuilds the config; the file may be gone by then."""
    gone = str(tmp_path / "gone.npz")
    assert resolve_inputs(gone, "ab" * 32) == (gone, "ab" * 32)
