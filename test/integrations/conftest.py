"""The training-framework tests: offline, and one intra-op thread per test."""

import os

import pytest
import torch

# nothing in these tests may reach the Hugging Face Hub: every model is built from a config, every data set made
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """The models are tiny: on a shared 2-core machine a second intra-op thread costs more in synchronization than
    it saves (a 5-step Trainer run: 0.7 s on one thread, 2.5 s on two, measured under load). Module-scoped, so
    that it is in force before a module's own fixtures train: a run and its resumed copy must use the same
    thread count, since another count sums in another order."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
