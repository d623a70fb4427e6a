"""Fixtures shared by the kernel tests."""
import pytest
import torch


@pytest.fixture
def threads():
    """Restores torch's thread count after a test that changes it."""
    saved = torch.get_num_threads()
    yield
    torch.set_num_threads(saved)
