"""Config behaviour the rest of the suite let through when changed by one line (mutation review,
session 58): boundary values of the trainer's knobs, top_k 1 recomputing old log-probs, the last
--set winning, a value holding '=', a trainer seed the file sets, keys that would act on nothing,
the model folder checked with model.init set, errors naming the key that is wrong."""
import pytest

from controller.config import ConfigError, from_dict, load_config
from controller.config_overrides import parse_override

PLACE = "placement: {generation: [1], trainer: [2]}\n"


def test_the_last_set_of_a_key_wins_over_an_earlier_set_of_its_section(tmp_path):
    """O1: parse_overrides moves a repeated key to its last place; without it the section's
    mapping, typed in between, was applied after and won."""
    f = tmp_path / "c.yaml"
    f.write_text(PLACE)
    cfg = load_config(f, overrides=["train.iterations=5", "train={iterations: 3}", "train.iterations=7"])
    assert cfg.train.iterations == 7


def test_a_set_value_may_hold_an_equals_sign():
    """O2: the key ends at the first '='."""
    assert parse_override("logging.experiment=lr=1e-5") == ("logging.experiment", "lr=1e-5")
    assert parse_override("task.kwargs.system=a=b") == ("task.kwargs.system", "a=b")


def test_top_k_1_filters_tokens_so_the_trainer_recomputes_old_log_probs():
    """F7: top_k 1 (> 0) filters the distribution as any top_k does; only 0 and -1 are off."""
    assert from_dict({"train": {"top_k": 1}}).trainer.recompute_old_logprobs is True
    assert from_dict({"train": {"top_k": -1}}).trainer.recompute_old_logprobs is False


def test_a_trainer_seed_the_file_sets_is_kept():
    """F8: only the trainer keys the file leaves out follow the train section."""
    cfg = from_dict({"train": {"seed": 3}, "trainer": {"seed": 11}})
    assert cfg.trainer.seed == 11
    assert from_dict({"train": {"seed": 3}}).trainer.seed == 3


def test_update_every_1_without_a_ranker_is_refused():
    """C4: any update_every > 0 (1 included) updates a ranker that ranker.kind: none lacks."""
    with pytest.raises(ConfigError, match="ranker.update_every: 1 updates a ranker online"):
        from_dict({"ranker": {"update_every": 1}})


def test_a_scale_out_at_iteration_0_of_a_static_placement_is_refused():
    """C5: force_scale_out_at 0 adds a joiner as any >= 0 does (-1 is never)."""
    with pytest.raises(ConfigError, match="placement.force_scale_out_at: 0 adds a joining"):
        from_dict({"placement": {"generation": [1], "trainer": [2], "elastic": False, "force_scale_out_at": 0}})


def test_eval_before_train_alone_makes_the_run_evaluate():
    """C3: the test split is checked at start for a run whose only evaluation is eval_before_train."""
    assert from_dict({"train": {"eval_before_train": True}}).train.evaluates
    assert not from_dict({}).train.evaluates


def test_the_set_blamed_is_the_one_holding_the_bad_value_not_a_later_section_set(tmp_path):
    """O12: a later --set of the key's section that does not hold the key is not its setter."""
    f = tmp_path / "c.yaml"
    f.write_text(PLACE)
    with pytest.raises(ConfigError) as e:
        load_config(f, overrides=["train.iterations=0", "train={batch_prompts: 4}"])
    assert str(e.value).startswith("--set train.iterations=0: train.iterations")


def test_a_set_under_a_section_the_file_leaves_empty(tmp_path):
    """O13: `train:` with nothing after it (YAML null) is an empty section a --set may fill."""
    f = tmp_path / "c.yaml"
    f.write_text(PLACE + "train:\n")
    assert load_config(f, overrides=["train.iterations=3"]).train.iterations == 3


def test_multi_turn_workers_without_an_env_is_refused():
    """U2: multi_turn.workers acts only with multi_turn.env."""
    with pytest.raises(ConfigError, match="multi_turn.workers: 8 acts only with multi_turn.env"):
        from_dict({"multi_turn": {"workers": 8}})


def test_a_utf16_big_endian_config_file_is_read(tmp_path):
    """Y6: both UTF-16 byte orders (with their BOM) are read, not only little-endian."""
    f = tmp_path / "c.yaml"
    f.write_bytes((PLACE + "train: {iterations: 4}\n").encode("utf-16-be").join([b"\xfe\xff", b""]))
    assert load_config(f).train.iterations == 4


@pytest.mark.parametrize("trainer, said", [
    ({"filter_groups": True}, "trainer.filter_groups: the filter picks the groups"),
    ({"algorithm": "gpg"}, "trainer.algorithm gpg: its advantages are scaled"),
    ({"rollout_is": "token", "rollout_is_batch_normalize": True}, "trainer.rollout_is_batch_normalize: the importance"),
])
def test_streaming_modes_note_each_setting_that_trains_at_step(trainer, said):
    """N6-N8: each reason the trainer waits for the iteration's last sample is said at start in
    a streaming mode (and none in a batch mode)."""
    from controller.config_notes import whitening_note

    assert said in (whitening_note(from_dict({"trainer": trainer, "pipeline": {"mode": "stream"}})) or "")
    assert whitening_note(from_dict({"trainer": trainer, "pipeline": {"mode": "batch"}})) is None


def test_model_init_vocab_size_at_the_bootstrap_minimum_is_taken(tmp_path):
    """P1: 258 (256 bytes + EOS + PAD) is the least the bootstrap takes: accepted; 257 refused."""
    from controller.preflight import check_model_folder
    from workers.tokenizer import min_bpe_vocab

    low = min_bpe_vocab()
    check_model_folder(tmp_path / "m", init={"vocab_size": low})
    with pytest.raises(ConfigError, match=f"model.init.vocab_size: {low - 1} is below {low}"):
        check_model_folder(tmp_path / "m", init={"vocab_size": low - 1})


def test_a_model_folder_is_checked_even_when_model_init_is_set(tmp_path):
    """P2: model.init builds a model only where the folder has none; a folder holding one (a
    re-run of the quickstart) is checked as any model folder, its missing weights said here."""
    from controller.preflight import check_model_folder
    from workers.model import CausalLM, ModelConfig, init_weights, save_pretrained
    from workers.tokenizer import train_bpe

    p = tmp_path / "m"
    cfg = ModelConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)
    save_pretrained(init_weights(CausalLM(cfg)), p)
    train_bpe(["1 + 2 = 3"] * 10, vocab_size=300).save(p)
    check_model_folder(p, init={"vocab_size": 300})
    for f in p.glob("*.safetensors*"):
        f.unlink()
    with pytest.raises(ConfigError, match="model.path: .*no \\*.safetensors files"):
        check_model_folder(p, init={"vocab_size": 300})


# ---- trainer / engine configs -------------------------------------------------------------------
def test_a_negative_clip_low_is_refused_in_the_run_config():
    """R2: no Range is declared on clip_low; only __post_init__'s >= 0 check stops a ratio floor
    of 1 + |clip_low| (above 1: every token clipped from below)."""
    with pytest.raises(ConfigError, match="trainer.clip_low must be >= 0, got -0.1"):
        from_dict({"trainer": {"clip_low": -0.1}})


def test_clip_low_1_is_refused_where_the_loss_has_a_floor():
    """R16: clip_low 1 puts ppo's ratio floor at 0 (no clip below): refused, as any >= 1."""
    from workers.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.clip_low must be < 1, got 1.0"):
        TrainerConfig(clip_low=1.0)


def test_dual_clip_1_is_refused():
    """R4: the dual clip's c must be > 1 (verl's clip_ratio_c); 1 is refused, 1.5 taken."""
    from workers.trainer.config import TrainerConfig

    assert TrainerConfig(dual_clip=1.5).dual_clip == 1.5
    with pytest.raises(ValueError, match=r"trainer.dual_clip must be > 1 \(or null\), got 1.0"):
        TrainerConfig(dual_clip=1.0)


def test_a_discount_above_1_is_refused():
    """R5: gamma > 1 grows the returns without bound."""
    from workers.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match=r"trainer.gamma and trainer.gae_lambda must be in \[0, 1\]"):
        TrainerConfig(algorithm="ppo", gamma=1.01)


def test_an_overlong_buffer_as_long_as_the_response_cap_is_taken():
    """R6: overlong_buffer may equal max_response_tokens (the penalty ramps over every token)."""
    cfg = from_dict({"train": {"max_tokens": 16}, "trainer": {"overlong_buffer": 16}})
    assert (cfg.trainer.overlong_buffer, cfg.trainer.max_response_tokens) == (16, 16)


def test_token_level_rejection_is_refused_with_geo_mean():
    """K4: geo_mean, like gspo, averages each sequence's tokens over all of them here."""
    from workers.trainer.config import TrainerConfig

    with pytest.raises(ValueError, match="trainer.rollout_rs: token_k1 rejects single tokens, and policy_loss 'geo_mean'"):
        TrainerConfig(policy_loss="geo_mean", loss_agg="seq_mean", rollout_rs="token_k1", rollout_rs_threshold=2.0)


def test_one_kv_block_is_refused_naming_num_blocks():
    """G1, G10: one block leaves no copy-on-write block for a group; the key named is the one set."""
    from workers.generation.config import EngineConfig

    with pytest.raises(ValueError, match="engine.num_blocks: must give at least two blocks of 16 tokens, got 1"):
        EngineConfig(num_blocks=1, block_size=16)
    with pytest.raises(ValueError, match="engine.kv_cache_tokens: must give at least two blocks of 16 tokens"):
        EngineConfig(kv_cache_tokens=16, block_size=16)


def test_the_ranker_reads_a_chats_last_user_turn_and_its_text_parts():
    """W6-W8: prompt_text of a chat item with an empty (or blank) prompt is its last user turn,
    OpenAI-style text parts joined."""
    from workers.types import TaskPrompt, prompt_text

    chat = ({"role": "user", "content": "first"}, {"role": "assistant", "content": "x"},
            {"role": "user", "content": [{"type": "text", "text": "second"}, {"type": "image"}]})
    assert prompt_text(TaskPrompt("", "a", "t", messages=chat)) == "second"
    assert prompt_text(TaskPrompt("  ", "a", "t", messages=chat)) == "second"


def test_a_model_init_folder_that_cannot_be_written_is_refused_at_start(tmp_path, monkeypatch):
    """P13: model.init writes the built model after the whole SFT warm start. A fake os.access:
    the suite may run as root, for whom a read-only folder is still writable."""
    import controller.preflight as preflight

    monkeypatch.setattr(preflight.os, "access", lambda path, mode: False)
    with pytest.raises(ConfigError, match="cannot be written, and model.init builds the model there"):
        preflight.check_model_folder(tmp_path / "m", init={"vocab_size": 300})
