"""Fixtures shared across the test tree."""

import pytest
import torch


@pytest.fixture(scope="module")
def one_torch_thread():
    """One intra-op thread for a module of tiny models: they gain nothing from a second one, and on a
    busy 2-core machine two OpenMP threads spin-wait on each other (test_dispatch.py: 8 s with one
    thread, 70 s with two; scoring 10x slower). Results do not depend on it."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)
