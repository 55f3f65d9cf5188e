"""The frontend and the offline LLM read a model directory's EOS ids and vocabulary size through
one reader (client/model_files.py), so they stop on the same tokens."""

from __future__ import annotations

import json
import logging

from pagedserve.client.model_files import eos_token_ids, vocab_size


class _Tokenizer:
    def __init__(self, eos=None, size=100):
        self.eos_token_id, self.size = eos, size

    def __len__(self):
        return self.size


def _model(tmp_path, config=None, generation_config=None):
    for name, content in (("config.json", config), ("generation_config.json", generation_config)):
        if content is not None:
            (tmp_path / name).write_text(content if isinstance(content, str) else json.dumps(content))
    return tmp_path


def test_a_null_eos_in_generation_config_means_none_there_not_config_jsons(tmp_path):
    model = _model(tmp_path, {"eos_token_id": 7}, {"eos_token_id": None})
    assert eos_token_ids(model, _Tokenizer()) == []
    assert eos_token_ids(model, _Tokenizer(eos=3)) == [3]


def test_generation_config_eos_ids_come_first_then_config_json_then_the_tokenizers(tmp_path):
    assert eos_token_ids(_model(tmp_path, {"eos_token_id": 7}, {"eos_token_id": [5, 6]}), _Tokenizer(eos=6)) == [5, 6]
    (tmp_path / "generation_config.json").unlink()
    assert eos_token_ids(tmp_path, _Tokenizer(eos=2)) == [2, 7]


def test_an_unreadable_json_file_is_logged_and_read_as_empty(tmp_path, caplog):
    model = _model(tmp_path, {"eos_token_id": 7, "vocab_size": 64}, "{not json")
    with caplog.at_level(logging.WARNING, logger="pagedserve.client.model_files"):
        assert eos_token_ids(model, _Tokenizer(eos=1)) == [1, 7]
    assert "generation_config.json" in caplog.text
    (tmp_path / "config.json").write_text("{not json either")
    assert vocab_size(model, _Tokenizer(size=50)) == 50


def test_the_vocabulary_is_the_embeddings_rows_when_config_json_says_so(tmp_path):
    assert vocab_size(_model(tmp_path, {"vocab_size": 128}), _Tokenizer(size=100)) == 128
    assert vocab_size(_model(tmp_path, {"vocab_size": 0}), _Tokenizer(size=100)) == 100
