"""A study's attention inputs: the default synthetic model, or activations saved to a file.

A study that runs attention reads Q, K, V and dO either from the documented synthetic model
(`fp4lab.analysis.synthetic_inputs`, seeded by the run's seed) or from a file that
`fp4lab.analysis.save_inputs` wrote from a real model (`fp4lab.analysis.load_inputs` reads
it; a file without dO gets one drawn as `AttentionInputs.with_do` says). Its config carries
two fields for this, ``inputs`` (the file, None for the synthetic model) and
``inputs_sha256``, and calls `resolve_inputs` in its ``__post_init__``: the path is made
absolute and the file's hash recorded, so the results folder's config.json names the very
bytes that were read, a file that is missing or unreadable is refused before anything runs,
and a resumed run whose file has changed since is refused by name. `study_inputs` gives a
cell its tensors; `describe_inputs` says in the report which input was used.
"""

from __future__ import annotations

from pathlib import Path

from fp4lab.analysis import AttentionInputs, load_inputs, synthetic_inputs

__all__ = ["resolve_inputs", "study_inputs", "describe_inputs"]


def resolve_inputs(path: str | None, sha256: str | None) -> tuple[str | None, str | None]:
    """(absolute path, sha256) of a config's inputs file, checked; (None, None) without one.

    A file that no longer exists is accepted only with its recorded hash (a stored run's
    config read back to rebuild its report); computing with it then fails at its first cell.

    Raises:
        ValueError: a hash without a file; a missing file; a file `load_inputs` refuses (its
            message names the file and the rule); a file whose hash is not the one given.
    """
    if path is None:
        if sha256 is not None:
            raise ValueError("inputs_sha256 is the hash of an inputs file: set inputs too, or "
                             "drop inputs_sha256")
        return None, None
    if not isinstance(path, str) or not path:
        raise ValueError(f"inputs must be the path of a .npz or .safetensors file, got {path!r}")
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        if sha256 is not None:
            return str(resolved), sha256
        raise ValueError(f"inputs: no such file {path!r} (write one with "
                         "fp4lab.analysis.save_inputs)")
    found = load_inputs(resolved).record["sha256"]
    if sha256 is not None and sha256 != found:
        raise ValueError(f"inputs_sha256: the file {str(resolved)!r} has sha256 {found[:12]}..., "
                         f"not the recorded {sha256[:12]}... (the file changed since)")
    return str(resolved), found


def study_inputs(path: str | None, seed: int, **synthetic) -> AttentionInputs:
    """Q, K, V, dO from the file at `path`, or from the synthetic model with the `synthetic`
    fields of `fp4lab.analysis.SyntheticConfig` and `seed` (also the seed of a missing dO)."""
    if path is None:
        return synthetic_inputs(seed=seed, **synthetic)
    return load_inputs(path).with_do(seed)


def describe_inputs(path: str | None, sha256: str | None, **synthetic) -> str:
    """A sentence for a report's setup: which input the study read."""
    if path is None:
        fields = ", ".join(f"{k} {v}" for k, v in synthetic.items())
        return ("the default synthetic model (fp4lab.analysis.synthetic_inputs: outlier "
                "channels, an attention sink, heavy-tailed V, a small dO), "
                f"{fields}, seeded by the run's seed")
    return (f"activations read from {path} (sha256 {sha256}); the config's synthetic sizes "
            "are not used")
