"""Fixtures shared by several test modules (helpers live in ``tests/helpers.py``)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread() -> Iterator[None]:
    """Small tensors on a shared 2-core machine: a second thread only adds contention.

    One thread also keeps float reductions, hence runs, reproducible within a module.
    """
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
