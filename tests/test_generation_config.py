"""A checkpoint's generation_config.json: its sampling settings read as the server recommends them,
and bad values refused in one line."""

import pytest


def test_generation_config_is_read_and_checked(tmp_path):
    from candelabra.core.server.generation_config import recommended_sampling
    from candelabra.core.weights import CheckpointError

    class Folder:
        path = tmp_path

    assert recommended_sampling(Folder()) == {}
    config = tmp_path / "generation_config.json"
    config.write_text('{"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "do_sample": true}')
    assert recommended_sampling(Folder()) == {"temperature": 0.7, "top_p": 0.8, "top_k": 20,
                                              "repetition_penalty": 1.05}
    config.write_text('{"temperature": "hot"}')
    with pytest.raises(CheckpointError, match="temperature must be a number"):
        recommended_sampling(Folder())
    config.write_text("{broken")
    with pytest.raises(CheckpointError, match="generation_config.json: cannot be read as JSON"):
        recommended_sampling(Folder())
