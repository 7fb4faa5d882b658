# -*- coding: utf-8 -*-
# Importing fla_falcon first turns on Triton's interpreter (and one-config autotuning) when no GPU
# is present, before triton or fla define any kernel: see fla_falcon/_platform.py.
import os

import fla_falcon  # noqa: F401
import pytest
import torch

DEVICE = 'cuda' if torch.cuda.is_available() else 'cpu'
INTERPRET = os.environ.get('TRITON_INTERPRET') == '1'


@pytest.fixture
def device():
    return DEVICE


def pytest_collection_modifyitems(config, items):
    skip_gpu = pytest.mark.skip(reason='needs a CUDA GPU')
    for item in items:
        if 'gpu' in item.keywords and DEVICE != 'cuda':
            item.add_marker(skip_gpu)
