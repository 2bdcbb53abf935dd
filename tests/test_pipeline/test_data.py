"""Calibration text: files of each kind, a directory, packing into disjoint calibration and held-out windows."""

from __future__ import annotations

import json
import signal
import sys
import time
import types

import pytest

pytest.importorskip("transformers")
from transformers import AutoTokenizer  # noqa: E402

from quantlib.pipeline import PipelineError  # noqa: E402
from quantlib.pipeline.data import iter_texts, load_windows, pack  # noqa: E402
from quantlib.pipeline.model import EMBEDDED_DIR, EMBEDDED_TEXT  # noqa: E402
from tests.test_pipeline._models import stdlib_text, write_jsonl, write_text  # noqa: E402


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(EMBEDDED_DIR, local_files_only=True)


def test_byte_tokenizer_ids_are_bytes(tok):
    text = "def f(x):\n    return 'é'\n"
    assert tok(text, add_special_tokens=False)["input_ids"] == list(text.encode())
    assert tok.decode(list(text.encode())) == text


def test_text_jsonl_and_directory_give_the_same_documents(tmp_path):
    (tmp_path / "d").mkdir()
    write_text(tmp_path / "d" / "a.txt", 1000)
    (tmp_path / "d" / "skip.bin").write_bytes(b"\x00\xff")
    assert list(iter_texts(str(tmp_path / "d"))) == [stdlib_text(1000)]
    docs = list(iter_texts(str(write_jsonl(tmp_path / "x.jsonl", n_docs=4))))
    assert len(docs) == 4 and "".join(docs) == stdlib_text()[: len("".join(docs))]


def test_parquet_text_column(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"body": ["one doc", "two doc"]}), tmp_path / "x.parquet")
    assert list(iter_texts(str(tmp_path / "x.parquet"), "body")) == ["one doc", "two doc"]
    with pytest.raises(PipelineError, match="no text column 'text' .*\\['body'\\]"):
        list(iter_texts(str(tmp_path / "x.parquet")))


def test_windows_are_disjoint_and_in_order(tok):
    w = load_windows(tok, None, EMBEDDED_TEXT, "text", 3, 2, 16)
    assert w.calib.shape == (3, 16) and w.held_out.shape == (2, 16)
    ids = open(EMBEDDED_TEXT, "rb").read()[: 5 * 16]
    assert w.calib.flatten().tolist() + w.held_out.flatten().tolist() == list(ids)
    assert [b.shape[0] for b in w.batches("calib", 2)] == [2, 1]


def test_documents_are_separated_by_eos(tok):
    w = pack(tok, iter(["ab", "cd"]), "mem", 1, 1, 3)
    assert w.calib.tolist() == [[97, 98, tok.eos_token_id]] and w.held_out.tolist() == [[99, 100, tok.eos_token_id]]


def test_parquet_without_pyarrow_names_the_package(tmp_path, monkeypatch):
    (tmp_path / "x.parquet").write_bytes(b"PAR1")
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # as when it is not installed
    monkeypatch.setitem(sys.modules, "pyarrow.parquet", None)
    with pytest.raises(PipelineError, match=r"x.parquet: reading Parquet needs pyarrow \(pip install pyarrow\)"):
        list(iter_texts(str(tmp_path / "x.parquet")))


def test_directory_of_text_files_in_path_order(tmp_path, tok):
    """Every text / JSONL file under the directory, sorted by path (subdirectories included), other files skipped."""
    d = tmp_path / "corpus"
    (d / "b").mkdir(parents=True)
    (d / "z.txt").write_text("zz")
    (d / "b" / "a.md").write_text("ba")
    (d / "a.jsonl").write_text(json.dumps({"text": "aj"}) + "\n")
    (d / "notes.bin").write_bytes(b"\x00\x01")
    assert list(iter_texts(str(d))) == ["aj", "ba", "zz"]
    w = load_windows(tok, str(d), None, "text", 2, 1, 3)
    assert w.calib.tolist() == [[97, 106, tok.eos_token_id], [98, 97, tok.eos_token_id]] and w.source == str(d)
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "x.bin").write_bytes(b"\x00")
    with pytest.raises(PipelineError, match="empty: a directory with no text, JSONL or Parquet files"):
        list(iter_texts(str(tmp_path / "empty")))


def test_dataset_name_without_the_datasets_package(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)
    with pytest.raises(PipelineError, match="no_such_corpus: no such file or directory, and the `datasets` package .* is not installed"):
        list(iter_texts("no_such_corpus"))


def test_dataset_name_not_cached_fails_in_seconds_offline():
    """A name that is not in the local cache: the real `datasets`, offline for the call, fails fast and never reaches
    the network (here there is none to reach: a lookup would hang until the alarm)."""
    datasets = pytest.importorskip("datasets")
    flags = {f: getattr(datasets.config, f) for f in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE") if hasattr(datasets.config, f)}

    def hung(*_):
        raise TimeoutError("the dataset lookup did not fail within 60 s")

    old = signal.signal(signal.SIGALRM, hung)
    signal.alarm(60)
    start = time.monotonic()
    try:
        with pytest.raises(
            PipelineError, match="no-such-org/no-such-corpus: not a file, and not a Hugging Face dataset in the local cache"
        ):
            list(iter_texts("no-such-org/no-such-corpus"))
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert time.monotonic() - start < 10  # measured: 0.7 s offline; 30 s of retries when the lookup goes online
    assert {f: getattr(datasets.config, f) for f in flags} == flags  # the offline switch was for this call only


class _Rows(list):
    """What ``datasets.load_dataset(..., split=...)`` returns as far as the pipeline reads it: rows and column names."""

    column_names = ["content", "id"]


def test_cached_dataset_without_the_text_field_or_enough_tokens(monkeypatch, tok):
    """A cached dataset read with both offline switches on for the call (and off again after), its columns named
    when the text field is missing, too few tokens refused. `datasets` stands in here (installed or not)."""
    seen = {}

    def load_dataset(name, config, split, download_mode):
        seen.update(
            name=name, config=config, split=split, offline=(fake.config.HF_HUB_OFFLINE, fake.config.HF_DATASETS_OFFLINE), mode=download_mode
        )
        return _Rows([{"content": "abc", "id": 0}, {"content": "def", "id": 1}])

    fake = types.SimpleNamespace(config=types.SimpleNamespace(HF_HUB_OFFLINE=False, HF_DATASETS_OFFLINE=False), load_dataset=load_dataset)
    monkeypatch.setitem(sys.modules, "datasets", fake)
    with pytest.raises(
        PipelineError, match=r"org/corpus:sub:validation: no text field 'text' \(columns: \['content', 'id'\]\); pass --text-field"
    ):
        list(iter_texts("org/corpus:sub:validation"))
    assert seen == dict(name="org/corpus", config="sub", split="validation", offline=(True, True), mode="reuse_cache_if_exists")
    assert (fake.config.HF_HUB_OFFLINE, fake.config.HF_DATASETS_OFFLINE) == (False, False)
    assert list(iter_texts("org/corpus", "content")) == ["abc", "def"] and seen["split"] == "train"
    with pytest.raises(PipelineError, match=r"org/corpus: 8 tokens, fewer than the 30 the run needs"):
        load_windows(tok, "org/corpus", None, "content", 2, 1, 10)
