"""patch_sdpa says so when its block routed no call (the model kept the original SDPA)."""

import warnings

import pytest
import torch
import torch.nn.functional as F

from fp4lab.analysis import patch_sdpa


def test_a_block_that_routed_nothing_warns():
    sdpa = F.scaled_dot_product_attention  # bound before the block: never routed
    q = torch.randn(1, 1, 8, 16)
    with pytest.warns(RuntimeWarning, match=r"patch_sdpa\('nvfp4'\) routed no scaled_dot_product"):
        with patch_sdpa("nvfp4"):
            sdpa(q, q, q)


def test_a_block_that_routed_a_call_is_silent():
    q = torch.randn(1, 1, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with patch_sdpa("nvfp4", block_m=16, block_n=16):
            F.scaled_dot_product_attention(q, q, q)


def test_an_error_in_the_block_is_not_hidden_by_the_warning():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(KeyError), patch_sdpa("nvfp4"):
            raise KeyError("the model's own error")
