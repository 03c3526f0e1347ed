"""``min_tokens`` keeps EOS from being sampled, so the engine's log-probs there are of the
distribution without EOS. The trainer must take its own the same way, or a length-forced run
(every benchmark, as in the paper) trains with on-policy ratios of 1 - p(EOS) instead of 1."""
import pytest
import torch

from workers.generation.config import EngineConfig
from workers.generation.generate_all import generate_all
from workers.generation.factory import make_engine
from tests.trainer_helpers import synthetic_task, tiny_model_dir
from workers.trainer import TrainerConfig, TrainerWorker
from workers.trainer.packing import pack
from workers.trainer.step_math import prepare_batch
from workers.types import Request, SamplingParams

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    task = synthetic_task()
    # SFT'd, so the model ends its answers with EOS: p(EOS) is large where min_tokens forbids it
    return tiny_model_dir(tmp_path_factory, sft_steps=60), task


def engine_samples(model_dir, task, min_tokens, temperature):
    w = TrainerWorker(TrainerConfig(temperature=temperature, recompute_old_logprobs=True), model_dir, task,
                      device="cpu")
    eng = make_engine(EngineConfig(device="cpu", dtype="float32", kv_cache_tokens=2048, max_batch_size=8),
                      model_dir, eos_ids=w.eos_ids.tolist())  # as the controller gives them (stop_ids)
    items = task.prompts("train")[:6]
    reqs = [Request(i, torch.tensor(w.tokenizer.encode(w.tokenizer.format_prompt(it.prompt))), 24, min_tokens,
                    0.0, sampling=SamplingParams(temperature=temperature, seed=i)) for i, it in enumerate(items)]
    samples = generate_all(eng, reqs)
    w._prompts = dict(enumerate(items))
    return w, samples


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_forced_length_samples_are_on_policy(setup, temperature):
    model_dir, task = setup
    w, samples = engine_samples(model_dir, task, 24, temperature)
    assert all(s.min_tokens == 24 and len(s.output_ids) == 24 for s in samples)
    prepared = prepare_batch(w, samples)
    for p, s in zip(prepared, samples):
        assert torch.allclose(p.old_logp, s.logprobs, atol=5e-5), (p.old_logp - s.logprobs).abs().max()
    # and the mask mattered: without it the trainer's log-probs are lower where EOS was likely
    unmasked = [s.__class__(**{**s.__dict__, "min_tokens": 0}) for s in samples]
    gap = max((s.logprobs - p.old_logp).max().item() for s, p in zip(samples, prepare_batch(w, unmasked)))
    assert gap > 2e-3, gap  # 40x the tolerance above


def test_without_min_tokens_nothing_is_masked(setup):
    model_dir, task = setup
    w, samples = engine_samples(model_dir, task, 0, 1.0)
    for p, s in zip(prepare_batch(w, samples), samples):
        assert torch.allclose(p.old_logp, s.logprobs, atol=5e-5)
    assert pack([s.prompt_ids for s in samples], [s.output_ids for s in samples], "cpu",
                [0] * len(samples)).eos_blocked is None


def test_pack_marks_the_positions_before_min_tokens():
    b = pack([torch.tensor([1, 2]), torch.tensor([3])], [torch.tensor([4, 5, 6]), torch.tensor([7, 8])], "cpu", [2, 5])
    assert b.eos_blocked.tolist() == [True, True, False, True, True]


def test_every_eos_of_the_folder_stops_and_is_masked(setup, tmp_path):
    """An instruct model lists several EOS ids (config.json, generation_config.json): the engine
    stops on each, and min_tokens masks each in the sampler and in the trainer alike."""
    import json
    import shutil

    from workers.model import stop_ids

    model_dir, task = setup
    folder = tmp_path / "m"
    shutil.copytree(model_dir, folder)
    cfg = json.loads((folder / "config.json").read_text())
    eos = cfg["eos_token_id"]
    cfg["eos_token_id"] = [eos, 7]
    (folder / "config.json").write_text(json.dumps(cfg))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [eos, 9]}))
    assert stop_ids(folder, eos) == [eos, 7, 9]
    w, samples = engine_samples(str(folder), task, 24, 1.0)
    assert w.eos_ids.tolist() == [eos, 7, 9]
    for p, s in zip(prepare_batch(w, samples), samples):
        assert torch.allclose(p.old_logp, s.logprobs, atol=5e-5)
        assert not set(s.output_ids.tolist()) & {eos, 7, 9}
