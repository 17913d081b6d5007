"""Bad dataset input is one line naming where: a prompt column that is not text (bytes, lists, numbers) names the
column and type; a JSONL line that is not UTF-8 names the file and line."""

from __future__ import annotations

import pytest

from relayrl.config import DatasetConfig
from relayrl.experience.records import read_rows, records_from_rows


@pytest.mark.parametrize(
    ("value", "shown"), [(b"1+1=", "bytes (b'1+1=')"), ([1, 2], "list ([1, 2])"), (7, "int (7)")], ids=str
)
def test_a_prompt_that_is_not_text_is_refused_naming_the_column_and_type(value, shown):
    rows = [{"prompt": "2+2=", "answer": "4"}, {"prompt": value, "answer": "2"}]
    with pytest.raises(ValueError) as info:
        records_from_rows(rows, DatasetConfig(source="file", path="d.parquet"), "d.parquet")
    assert str(info.value) == (
        f"dataset d.parquet row 2: prompt field 'prompt' holds {shown}, not text; store prompts as strings "
        "(or chats in 'messages')"
    )


def test_a_jsonl_line_that_is_not_utf8_names_the_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "ok", "answer": "1"}\n{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError) as info:
        read_rows(path)
    assert str(info.value) == f"{path} line 2: not UTF-8 text (byte 0xe9 at column 16); save the file as UTF-8"
