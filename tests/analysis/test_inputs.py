"""The default input follows its documented model; files load safely or fail by name."""

import numpy as np
import pytest
import torch

from fp4lab.analysis.inputs import SyntheticConfig, load_inputs, save_inputs, synthetic_inputs

SMALL = dict(batch=2, heads=4, seq=96, head_dim=32)


def test_same_seed_same_tensors_other_seed_other_tensors():
    a, b = synthetic_inputs(**SMALL, seed=3), synthetic_inputs(**SMALL, seed=3)
    c = synthetic_inputs(**SMALL, seed=4)
    for name in ("q", "k", "v", "do"):
        assert torch.equal(getattr(a, name), getattr(b, name))
        assert not torch.equal(getattr(a, name), getattr(c, name))


def test_shapes_dtype_and_gqa():
    x = synthetic_inputs(**SMALL, kv_heads=2, dtype="float64")
    assert x.q.shape == (2, 4, 96, 32) and x.do.shape == (2, 4, 96, 32)
    assert x.k.shape == x.v.shape == (2, 2, 96, 32)
    assert {t.dtype for t in (x.q, x.k, x.v, x.do)} == {torch.float64}
    assert x.record["kind"] == "synthetic" and x.record["kv_heads"] == 2 and x.record["seed"] == 0


def test_attention_sink_draws_the_documented_score():
    """Key 0's score sits about sink_logit above a query's mean score and takes a large share
    of the probability, while its value row is small."""
    cfg = SyntheticConfig(**SMALL, seed=1)
    x = synthetic_inputs(cfg)
    s = (x.q.double() @ x.k.double().transpose(-1, -2)) / cfg.head_dim**0.5
    gap = (s[..., 0] - s[..., 1:].mean(-1)).mean().item()
    assert abs(gap - cfg.sink_logit) < 1.0
    assert torch.softmax(s, -1)[..., 0].mean() > 0.15
    v_rows = x.v.abs().mean(-1)
    assert (v_rows[..., 0] < v_rows[..., 1:].mean(-1)).all()


def test_outlier_channels_and_heavy_tails():
    cfg = SyntheticConfig(batch=1, heads=2, seq=4096, head_dim=64, seed=2)
    x = synthetic_inputs(cfg)
    channel_rms = (
        x.q[..., :-1].double().square().mean(dim=(0, 1, 2)).sqrt()
    )  # the sink channel aside
    big = channel_rms > 2
    assert big.sum() == cfg.outlier_channels
    v = x.v[..., 1:, :].double() / x.v[..., 1:, :].double().std(dim=-2, keepdim=True)
    kurtosis = (v**4).mean() / (v**2).mean() ** 2
    assert kurtosis > 5  # Student t with 3 dof: infinite kurtosis; a Gaussian gives 3
    assert x.do.abs().median() < 10 * cfg.do_scale


@pytest.mark.parametrize(
    "field, value",
    [
        ("seq", 0),
        ("heads", 3.0),
        ("kv_heads", 3),
        ("outlier_channels", 64),
        ("v_dof", 2),
        ("dtype", "float16"),
    ],
)
def test_bad_config_names_the_field(field, value):
    with pytest.raises(ValueError, match=field):
        SyntheticConfig(**{**SMALL, "head_dim": 64, field: value})


@pytest.mark.parametrize("suffix", [".npz", ".safetensors"])
def test_round_trip(tmp_path, suffix):
    x = synthetic_inputs(**SMALL, kv_heads=2)
    path = save_inputs(tmp_path / f"act{suffix}", x.q, x.k, x.v, x.do)
    y = load_inputs(path)
    for name in ("q", "k", "v", "do"):
        assert torch.equal(getattr(x, name), getattr(y, name))
    assert y.source == str(path) and len(y.record["sha256"]) == 64


def test_optional_do_drawn_from_the_seed(tmp_path):
    x = synthetic_inputs(**SMALL)
    y = load_inputs(save_inputs(tmp_path / "a.npz", x.q, x.k, x.v))
    assert y.do is None
    a, b = y.with_do(5), y.with_do(5)
    assert a.do.shape == x.do.shape and torch.equal(a.do, b.do)
    assert "seed 5" in a.record["do"]


def test_bfloat16_becomes_float32(tmp_path):
    x = synthetic_inputs(**SMALL)
    y = load_inputs(
        save_inputs(tmp_path / "a.safetensors", *(t.bfloat16() for t in (x.q, x.k, x.v)))
    )
    assert y.q.dtype == torch.float32 and torch.equal(y.q, x.q.bfloat16().float())


def test_missing_key_is_named_with_the_keys_present(tmp_path):
    path = tmp_path / "a.npz"
    np.savez(path, q=np.zeros((1, 1, 4, 8), np.float32), v=np.zeros((1, 1, 4, 8), np.float32))
    with pytest.raises(ValueError, match=r"no array named 'k'.*\['q', 'v'\]"):
        load_inputs(path)


@pytest.mark.parametrize(
    "arrays, match",
    [
        (dict(q=(1, 1, 4, 8), k=(1, 1, 4, 8), v=(1, 1, 5, 8)), "'k' and 'v'"),
        (dict(q=(1, 4, 8), k=(1, 1, 4, 8), v=(1, 1, 4, 8)), "'q'.*4-D"),
        (dict(q=(1, 3, 4, 8), k=(1, 2, 4, 8), v=(1, 2, 4, 8)), "multiple"),
        (dict(q=(1, 1, 4, 8), k=(1, 1, 4, 16), v=(1, 1, 4, 8)), "head_dim"),
        (dict(q=(1, 1, 4, 8), k=(1, 1, 4, 8), v=(1, 1, 4, 8), do=(1, 1, 4, 7)), "'do'"),
    ],
)
def test_bad_shapes_are_named(tmp_path, arrays, match):
    path = tmp_path / "a.npz"
    np.savez(path, **{n: np.zeros(s, np.float32) for n, s in arrays.items()})
    with pytest.raises(ValueError, match=match):
        load_inputs(path)


def test_pickle_is_refused(tmp_path):
    path = tmp_path / "a.npz"
    obj = np.empty((1,), dtype=object)
    obj[0] = {"payload": 1}
    np.savez(path, q=obj, k=np.zeros((1, 1, 4, 8)), v=np.zeros((1, 1, 4, 8)))
    with pytest.raises(ValueError, match="pickle"):
        load_inputs(path)
    torch.save({"q": torch.zeros(1)}, tmp_path / "a.pt")
    with pytest.raises(ValueError, match="never pickle"):
        load_inputs(tmp_path / "a.pt")


def test_integer_arrays_and_broken_files(tmp_path):
    path = tmp_path / "a.npz"
    np.savez(
        path, q=np.zeros((1, 1, 4, 8), np.int32), k=np.zeros((1, 1, 4, 8)), v=np.zeros((1, 1, 4, 8))
    )
    with pytest.raises(ValueError, match="'q'.*floating point"):
        load_inputs(path)
    (tmp_path / "b.npz").write_bytes(b"not a zip")
    with pytest.raises(ValueError, match="not a readable .npz"):
        load_inputs(tmp_path / "b.npz")
    (tmp_path / "c.safetensors").write_bytes(b"\x00" * 3)
    with pytest.raises(ValueError, match="not a readable safetensors"):
        load_inputs(tmp_path / "c.safetensors")
    with pytest.raises(FileNotFoundError, match="nowhere.npz"):
        load_inputs(tmp_path / "nowhere.npz")
