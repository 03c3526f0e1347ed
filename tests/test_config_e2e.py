"""Bad input found only once the processes are up (the controller's checks before any worker
builds anything): one ``config error`` line naming the key, exit code 2, no traceback."""
import torch

from runtime_helpers import ROOT, tiny_model, torchrun, write_config  # noqa: F401  (session-wide tiny model folder)


def _one_config_error(p) -> str:
    """The one ``config error`` line; every rank exited 2 (torchrun itself exits 1 with its
    summary of the ranks' codes) and no traceback came from the project's code."""
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("config error:")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-3000:]
    assert p.stderr.count("exitcode  : 2 ") == 3, p.stderr[-3000:]
    assert "controller error" not in p.stderr and "On WorkerInfo" not in p.stderr, p.stderr[-3000:]
    assert f'File "{ROOT}/controller' not in p.stderr and f'File "{ROOT}/workers' not in p.stderr, p.stderr[-3000:]
    return errors[0]


def test_a_mistyped_model_path_and_a_cuda_engine_on_a_cpu_torch_are_one_line(tmp_path, tiny_model):  # noqa: F811
    # model.path with no model and no model.init: was two remote FileNotFoundError tracebacks, exit 1
    p = torchrun(write_config(tmp_path, str(tmp_path / "nomodel"), logging__logdir=str(tmp_path / "a")), timeout=120)
    assert _one_config_error(p).startswith(f"config error: model.path: {tmp_path / 'nomodel'} does not exist and "
                                           "model.init is not set")
    if not torch.cuda.is_available():  # was an AssertionError traceback from the generation rank
        p = torchrun(write_config(tmp_path, tiny_model, engine__device="cuda", logging__logdir=str(tmp_path / "b")),
                     timeout=120)
        assert _one_config_error(p) == ("config error: engine.device: 'cuda', but CUDA is not available on rank 1 "
                                        "(generation); set engine.device: cpu, or \"\" to use CUDA when there is a GPU")


def test_a_bad_prompt_template_in_the_model_folder_is_one_line(tmp_path, tiny_model):  # noqa: F811
    import json
    import shutil

    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    tc = folder / "tokenizer_config.json"
    cfg = json.loads(tc.read_text()) if tc.exists() else {}
    tc.write_text(json.dumps({**cfg, "prompt_template": 'Reply as {"answer": N}. Q: {prompt}'}))
    p = torchrun(write_config(tmp_path, str(folder), logging__logdir=str(tmp_path / "c")), timeout=120)
    line = _one_config_error(p)
    assert line.startswith(f"config error: model.path {folder}: tokenizer: ") and "{{ and }}" in line, line


def test_a_user_task_whose_prompts_are_not_task_prompts_and_mismatched_weights_are_one_line(tmp_path, tiny_model):  # noqa: F811
    # a task returning dicts was AttributeError tracebacks; weights that do not match config.json
    # were 7 load_state_dict tracebacks, one from each rank loading them
    import json
    import shutil

    user = tmp_path / "tasks.py"
    user.write_text("class Dicts:\n    def prompts(self, split):\n        return [{'prompt': 'x', 'answer': '1'}]\n"
                    "    def score(self, prompt, completion):\n        return 0.0\n")
    p = torchrun(write_config(tmp_path, tiny_model, task__name=f"{user}:Dicts", task__kwargs={},
                              logging__logdir=str(tmp_path / "a")), timeout=120)
    assert _one_config_error(p) == (f"config error: task ({user}:Dicts) train prompts: task.prompts('train')[0] is a "
                                    "dict, not a workers.types.TaskPrompt (TaskPrompt(prompt=..., answer=..., "
                                    "task=...)): {'prompt': 'x', 'answer': '1'}")
    folder = tmp_path / "model"
    shutil.copytree(tiny_model, folder)
    cfg = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_hidden_layers": cfg["num_hidden_layers"] + 1}))
    p = torchrun(write_config(tmp_path, str(folder), logging__logdir=str(tmp_path / "b")), timeout=120)
    assert _one_config_error(p).startswith(f"config error: model.path: {folder}: the weights do not match "
                                           "config.json: missing ['model.layers.")


def test_eval_only_with_the_console_is_refused_naming_both(tmp_path, tiny_model):  # noqa: F811
    p = torchrun(write_config(tmp_path, tiny_model, train__eval_only=True), extra=["--repl"], timeout=120, stdin="")
    errors = [ln for ln in p.stderr.splitlines() if ln.startswith("config error:")]
    assert p.returncode != 0 and len(errors) == 1, p.stderr[-3000:]
    assert errors[0].startswith("config error: ") and ": train.eval_only evaluates and stops, --repl opens a console" in errors[0]
    # refused before any work (exit 2; torchrun stops the ranks still exiting when it sees the
    # first one go, -15, which on a loaded machine may be all but one)
    assert p.stderr.count("exitcode  : 2 ") >= 1 and "controller error" not in p.stderr, p.stderr[-3000:]
    assert not (tmp_path / "run").exists()


def test_a_context_past_the_models_is_one_line(tmp_path, tiny_model):  # noqa: F811
    # the tiny model's 4,096 positions; the cache holds 16,368 tokens of one sequence: each engine
    # refused it in its constructor, 214 lines of nested tracebacks, exit 1 (diff review, s60)
    p = torchrun(write_config(tmp_path, tiny_model, engine__max_model_len=5000, engine__kv_cache_tokens=16384,
                              logging__logdir=str(tmp_path / "d")), timeout=120)
    assert _one_config_error(p) == ("config error: engine.max_model_len: 5000 is past the model's context "
                                    "(max_position_embeddings 4096 in its config.json); set it to at most 4096, "
                                    "or leave it unset (0) for the model's")
