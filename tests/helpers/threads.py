"""Torch's thread count as a fixture body: ``pytest.fixture(params=[...])(set_threads)``."""

from __future__ import annotations

import torch


def set_threads(request):
    """The test runs at ``request.param`` torch threads; the count is restored after."""
    old = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(old)
