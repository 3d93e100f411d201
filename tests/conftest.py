from __future__ import annotations

import pytest

from pdserve.model.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny() -> LoadedModel:
    return load_model("tiny")
