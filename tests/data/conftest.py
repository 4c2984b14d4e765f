"""One small standard-library corpus (200 kB, a 400-id BPE) shared by the data tests."""

import pytest

from lstrain.data import DataConfig

STDLIB_BYTES = 200_000
VOCAB = 400


@pytest.fixture(scope="session")
def stdlib_config(tmp_path_factory) -> DataConfig:
    """The standard-library config; its cache folder lives for the session, so the BPE trains once."""
    return DataConfig(vocab_size=VOCAB, max_bytes=STDLIB_BYTES, cache_dir=str(tmp_path_factory.mktemp("cache")))
