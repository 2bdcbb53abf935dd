"""The model directories and data files of the pipeline tests, written once per session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def disk(tmp_path_factory):
    pytest.importorskip("transformers")
    from tests.test_pipeline._models import write_disk

    return write_disk(tmp_path_factory.mktemp("pipeline"))
