"""``verifier: reward_model`` (``workers/tasks/reward_model.py``): a sequence-classification reward
model's scores equal transformers' ``Qwen2ForSequenceClassification`` / ``LlamaForSequenceClassification``
on the same weights and tokens; a JSONL task scores with it (rows need no answer), a batch in one
call; bad folders and over-long texts are refused naming them; a real run trains on its rewards."""
import json
import shutil
from pathlib import Path

import pytest
import torch

from tests.runtime_helpers import iterations, tiny_model, torchrun, write_config  # noqa: F401
from workers.tasks import make_task
from workers.tasks.reward_model import RewardModelVerifier, load_scorer
from workers.types import TaskPrompt

transformers = pytest.importorskip("transformers", reason="transformers is the test-only reference")


def _rm_folder(tmp_path, model_dir, arch="Qwen2", chat_template=None):
    """A random tiny reward model with the tiny policy's tokenizer, written by transformers."""
    base = json.loads((Path(model_dir) / "config.json").read_text())
    cls = {"Qwen2": (transformers.Qwen2Config, transformers.Qwen2ForSequenceClassification),
           "Llama": (transformers.LlamaConfig, transformers.LlamaForSequenceClassification)}[arch]
    cfg = cls[0](vocab_size=base["vocab_size"], hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, num_labels=1, pad_token_id=0,
                 max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(1)
    model = cls[1](cfg).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.2)
    folder = tmp_path / f"rm_{arch}"
    model.save_pretrained(folder)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        if (Path(model_dir) / f).exists():
            shutil.copy(Path(model_dir) / f, folder / f)
    if chat_template:
        (folder / "chat_template.jinja").write_text(chat_template)
    return folder, model


ITEMS = [(TaskPrompt(prompt="What is 2 + 3?", answer="5", task="math"), " 5"),
         (TaskPrompt(prompt="Add 4 and 4.", answer="8", task="math"), " it is 8, I think"),
         (TaskPrompt(prompt="1 + 1", answer="2", task="math"), " 3")]


@pytest.mark.parametrize("arch", ["Qwen2", "Llama"])
def test_scores_equal_transformers(tmp_path, tiny_model, arch):  # noqa: F811
    folder, hf = _rm_folder(tmp_path, tiny_model, arch)
    rm = RewardModelVerifier(str(folder))
    got = rm.batch([p for p, _ in ITEMS], [c for _, c in ITEMS])
    tok = rm._tok
    for (p, c), score in zip(ITEMS, got):
        ids = torch.tensor([tok.encode(p.prompt + c, add_special_tokens=True)])
        with torch.no_grad():
            want = float(hf(ids).logits[0, 0])
        assert score == pytest.approx(want, abs=1e-4)
    assert len(set(round(x, 4) for x in got)) == 3  # the scores differ
    assert rm(*ITEMS[1]) == pytest.approx(got[1], abs=1e-5)  # one sample: a batch of one
    # a batch split in forwards of 2 gives the same scores
    assert RewardModelVerifier(str(folder), batch_size=2).batch([p for p, _ in ITEMS], [c for _, c in ITEMS]) \
        == pytest.approx(got, abs=1e-5)


def test_the_reward_models_chat_template_frames_the_text(tmp_path, tiny_model):  # noqa: F811
    template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
                "{% if add_generation_prompt %}<assistant>{% endif %}")
    folder, _ = _rm_folder(tmp_path, tiny_model, chat_template=template)
    rm = RewardModelVerifier(str(folder))
    assert rm.text(*ITEMS[0]) == "<user>What is 2 + 3?</user><assistant> 5</assistant>"
    chat = TaskPrompt(prompt="hi", answer="", task="t",
                      messages=({"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}))
    assert rm.text(chat, "yo") == "<system>be brief</system><user>hi</user><assistant>yo</assistant>"


def test_a_jsonl_task_scores_with_it_in_batches_and_rows_need_no_answer(tmp_path, tiny_model):  # noqa: F811
    import pickle

    from workers.tasks.scoring import safe_score_batch

    folder, _ = _rm_folder(tmp_path, tiny_model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": p.prompt, **({"answer": None} if i else {})}) + "\n"
                            for i, (p, _) in enumerate(ITEMS)))  # no answer field, or a null one
    task = make_task("jsonl", files=str(data), verifier="reward_model", verifier_kwargs={"path": str(folder)})
    items = task.prompts("train")
    assert [i.answer for i in items] == ["", "", ""]
    batch = task.score_batch(items, [c for _, c in ITEMS])
    assert batch == pytest.approx([task.score(i, c) for i, (_, c) in zip(items, ITEMS)], abs=1e-5)
    # the task pickles (a reward process rebuilds it) and scores the same after
    again = pickle.loads(pickle.dumps(task))
    assert again.score_batch(items, [c for _, c in ITEMS]) == pytest.approx(batch, abs=1e-6)
    # an over-long sample skips itself only: the others of its call are scored
    short = make_task("jsonl", files=str(data), verifier="reward_model",
                      verifier_kwargs={"path": str(folder), "max_length": 20})
    scored = safe_score_batch(short, items, [c for _, c in ITEMS])
    assert [why == "" for _, why, _ in scored] == [True, False, True]
    assert "over the reward model's max_length 20" in scored[1][1]
    assert [x for x, _, _ in scored[::2]] == pytest.approx(batch[::2], abs=1e-5)
    # a rule verifier still needs the answer field
    with pytest.raises(ValueError, match="missing field 'answer'"):
        make_task("jsonl", files=str(data), verifier="exact").prompts("train")


def test_bad_folders_and_long_texts_are_named(tmp_path, tiny_model):  # noqa: F811
    with pytest.raises(ValueError, match="verifier_kwargs.path: .* holds no config.json"):
        RewardModelVerifier(str(tmp_path / "nothing"))
    with pytest.raises(ValueError, match="architecture 'Qwen2ForCausalLM' is not a reward model"):
        RewardModelVerifier(tiny_model)
    folder, _ = _rm_folder(tmp_path, tiny_model)
    with pytest.raises(ValueError, match="verifier_kwargs.batch_size: an integer >= 1, got 0"):
        RewardModelVerifier(str(folder), batch_size=0)
    with pytest.raises(ValueError, match="27 tokens, over the reward model's max_length 4"):
        RewardModelVerifier(str(folder), max_length=4)(*ITEMS[1])
    # a folder that cannot score is refused when the task is built, not skipped sample by sample
    broken = tmp_path / "no_tokenizer"
    shutil.copytree(folder, broken)
    (broken / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="verifier_kwargs.path: .*tokenizer"):
        RewardModelVerifier(str(broken))
    wrong = tmp_path / "wrong_shapes"
    shutil.copytree(folder, wrong)
    conf = json.loads((wrong / "config.json").read_text())
    (wrong / "config.json").write_text(json.dumps({**conf, "hidden_size": 64}))
    with pytest.raises(ValueError, match="the weights do not match a Qwen2ForSequenceClassification of config.json"):
        RewardModelVerifier(str(wrong))
    data = tmp_path / "d.jsonl"
    data.write_text('{"prompt": "a"}\n')
    with pytest.raises(ValueError, match=r"verifier_kwargs: \['pth'\] are not options of the verifier 'reward_model'"):
        make_task("jsonl", files=str(data), verifier="reward_model", verifier_kwargs={"pth": "x"})
    assert load_scorer(folder).score.weight.shape == (1, 32)


def test_a_run_trains_on_the_reward_models_scores(tmp_path, tiny_model):  # noqa: F811
    folder, _ = _rm_folder(tmp_path, tiny_model)
    data = tmp_path / "d.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"What is {i} plus {i}?"}) + "\n" for i in range(16)))
    cfg = write_config(tmp_path, tiny_model, task__name="jsonl",
                       task__kwargs={"files": str(data), "verifier": "reward_model",
                                     "verifier_kwargs": {"path": str(folder)}},
                       train__iterations=2, train__eval_every=0, pipeline__mode="stream")
    p = torchrun(cfg, timeout=300)
    assert p.returncode == 0, p.stderr[-4000:]
    rows = iterations(tmp_path / "run")
    assert [r["iteration"] for r in rows] == [0, 1]
    assert all(r["metrics"]["skipped_samples"] == 0 for r in rows)
    assert any(r["metrics"]["reward_std"] > 0 for r in rows)  # the reward model's scores, not a constant
    assert all(r["metrics"]["grad_norm"] > 0 for r in rows)


def test_pooling_skips_trailing_pad_tokens_as_transformers_does(tmp_path, tiny_model):  # noqa: F811
    """A text ending in the pad token (pad = EOS, a chat template ending in it): transformers
    scores the rightmost token that is not pad; so does this."""
    folder, hf = _rm_folder(tmp_path, tiny_model)
    rm = RewardModelVerifier(str(folder))
    model, tok = rm._load(), rm._tok
    seqs = [torch.tensor(tok.encode("What is 2 + 3? 5")), torch.tensor(tok.encode("1 + 1 is 2"))]
    padded = [torch.cat([seqs[0], torch.tensor([0, 0])]), seqs[1]]  # pad_token_id 0 at the end
    got = model(padded, pad_id=0)[:, 0]
    for s, score in zip(padded, got.tolist()):
        with torch.no_grad():
            want = float(hf(s[None]).logits[0, 0])
        assert score == pytest.approx(want, abs=1e-4)
    assert got[0] == pytest.approx(float(model([seqs[0]], pad_id=0)[0, 0]), abs=1e-5)


def test_rope_frequencies_stay_fp32_in_a_bf16_model(tmp_path, tiny_model):  # noqa: F811
    """transformers keeps inv_freq fp32 in a bf16 model; a bf16 one is off by up to ~1 in cos/sin
    at positions in the thousands (rope_theta 1e6)."""
    from workers.model import load_pretrained

    folder, _ = _rm_folder(tmp_path, tiny_model)
    scorer = load_scorer(folder, "cpu", torch.bfloat16)
    assert scorer.score.weight.dtype == torch.bfloat16
    assert scorer.model.rotary_emb.inv_freq.dtype == torch.float32
    policy = load_pretrained(tiny_model, "cpu", torch.bfloat16)
    assert policy.model.rotary_emb.inv_freq.dtype == torch.float32
    assert policy.model.embed_tokens.weight.dtype == torch.bfloat16


def _bos_rm_folder(tmp_path, model_dir, chat_template=None):
    """A Llama reward model whose tokenizer.json adds a BOS to any text (as Llama's does)."""
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import processors

    folder, hf = _rm_folder(tmp_path, model_dir, "Llama", chat_template=chat_template)
    t = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    bos = "<|pad|>"  # (the tiny vocabulary is full: its PAD special token stands for the BOS)
    bid = t.token_to_id(bos)
    t.post_processor = processors.Sequence([
        processors.ByteLevel(trim_offsets=False),
        processors.TemplateProcessing(single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, bid)])])
    t.save(str(folder / "tokenizer.json"))
    cfg = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps({**cfg, "bos_token": bos}))
    return folder, hf


@pytest.mark.parametrize("template", [None, "{{ bos_token }}{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}"
                                            "{% endfor %}{{ eos_token }}"], ids=["plain", "chat"])
def test_scores_equal_transformers_with_a_bos_adding_tokenizer(tmp_path, tiny_model, template):  # noqa: F811
    """The ids scored are transformers': tokenizer(text) (one BOS) without a chat template,
    apply_chat_template(tokenize=True) with one (its own BOS, none added; the text ends in
    eos = pad_token_id 0, which pooling passes over)."""
    folder, hf = _bos_rm_folder(tmp_path, tiny_model, template)
    htok = transformers.AutoTokenizer.from_pretrained(folder)
    rm = RewardModelVerifier(str(folder))
    got = rm.batch([p for p, _ in ITEMS], [c for _, c in ITEMS])
    for (p, c), score in zip(ITEMS, got):
        if template is None:
            ids = htok(p.prompt + c)["input_ids"]
        else:
            ids = htok.apply_chat_template([{"role": "user", "content": p.prompt}, {"role": "assistant", "content": c}],
                                           tokenize=True, add_generation_prompt=False, return_dict=False)
        assert ids.count(htok.convert_tokens_to_ids("<|pad|>")) == 1
        with torch.no_grad():
            want = float(hf(torch.tensor([ids])).logits[0, 0])
        assert score == pytest.approx(want, abs=1e-4)


def test_a_text_of_exactly_max_length_tokens_is_scored(tmp_path, tiny_model):  # noqa: F811
    folder, _ = _rm_folder(tmp_path, tiny_model)
    rm = RewardModelVerifier(str(folder))
    n = len(rm._tok.encode(rm.text(*ITEMS[1]), add_special_tokens=True))
    assert isinstance(RewardModelVerifier(str(folder), max_length=n)(*ITEMS[1]), float)
    with pytest.raises(ValueError, match=f"{n} tokens, over the reward model's max_length {n - 1}"):
        RewardModelVerifier(str(folder), max_length=n - 1)(*ITEMS[1])
