"""The real tinker-cookbook's minimal loops, recipes/sl_loop.py and recipes/rl_loop.py, run unmodified (their
default losses: cross_entropy, stable_reinforce) against a real stack: Redis, `tinkerq worker --runtime torch`
and `tinkerq api` as processes; and so does its full RL loop, rl/train.py, in its async configuration, on the
demo's task written as a cookbook environment (cookbook_words). Offline: the datasets they load are local
directories (cookbook_data), the tokenizer is the served model's (cookbook_run). Only their config changes:
base_url, model name, data sizes."""

import json
import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

import pytest

from support import cookbook_data

pytestmark = pytest.mark.slow
RUNNER = Path(__file__).parents[1] / "support" / "cookbook_run.py"
RUN_TIMEOUT_S = 600  # bounds a recipe that hangs; a healthy run takes well under a minute


@pytest.fixture
def stack(start_worker, start_api):
    """A worker and an API serving `directory` under the cookbook's model name; returns the API's URL."""

    def start(directory: Path) -> str:
        served = {"TINKERQ_BASE_MODELS": f"{cookbook_data.MODEL_NAME}={directory}"}
        start_worker(TINKERQ_RUNTIME="torch", **served)
        return start_api(**served).url

    return start


def run_recipe(recipe: str, url: str, model_dir: Path, tmp_path: Path, *config: str) -> tuple[list[dict], str]:
    """Runs the recipe to its end in its own process; returns its metrics.jsonl rows and its output."""
    data = cookbook_data.write_hub_mirror(tmp_path / "hub", sl_rows=48, rl_rows=12)
    log_path = tmp_path / f"{recipe}-log"
    env = {**os.environ, "TINKER_API_KEY": "tml-test-key", "HF_HOME": str(tmp_path / "hf"),
           "PYTHONPATH": os.pathsep.join([str(RUNNER.parents[2]), str(RUNNER.parent)])}
    args = [sys.executable, str(RUNNER), recipe, str(model_dir), f"base_url={url}",
            f"model_name={cookbook_data.MODEL_NAME}", f"log_path={log_path}", *config]
    done = subprocess.run(args, cwd=data, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert done.returncode == 0, f"{recipe} failed:\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    output = done.stdout + done.stderr
    assert "Training completed" in output
    return [json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines()], output


def test_sl_loop_loss_falls(stack, tmp_path):
    from tinkerq import local_models

    model_dir = local_models.resolve("tinyq-micro")
    url = stack(model_dir)
    # 48 rows of 4 conversations, 8 a batch: 6 steps of the recipe's cross_entropy with its linear LR decay
    rows, _ = run_recipe("sl_loop", url, model_dir, tmp_path, "batch_size=8", "learning_rate=1e-2",
                      "max_length=1024", "lora_rank=8", "save_every=0")
    nll = [row["train_mean_nll"] for row in rows if "train_mean_nll" in row]
    assert len(nll) == 6, rows
    assert all(math.isfinite(x) for x in nll), nll
    assert nll[-1] < 0.5 * nll[0], nll
    assert (tmp_path / "sl_loop-log" / "checkpoints.jsonl").is_file()  # its final save_checkpoint


def test_rl_loop_runs_stable_reinforce(stack, tmp_path):
    model_dir = cookbook_data.cached_guesser()  # answers \boxed{d} with a random digit d: some rewards are 1
    url = stack(model_dir)
    # 12 questions, 4 a batch: 3 steps of 4 groups of 8 samples
    rows, output = run_recipe("rl_loop", url, model_dir, tmp_path, "batch_size=4", "group_size=8", "max_tokens=24",
                      "lora_rank=8", "save_every=0")
    config = json.loads((tmp_path / "rl_loop-log" / "config.json").read_text())
    assert config["loss_fn"] == "stable_reinforce"  # the recipe's default, which these tests leave alone
    steps = [row for row in rows if "reward/total" in row]
    assert len(steps) == 3, rows
    for row in steps:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    rewards = [row["reward/total"] for row in steps]
    assert any(0 < r < 1 for r in rewards), rewards
    # the recipe skips a batch whose groups all have equal rewards; most batches here must have trained, and a
    # trained batch's row carries the optimizer step's metrics
    assert output.count("all advantages zero, skipping training step") <= 1, output[-4000:]
    grad_norms = [row["grad_norm:mean"] for row in steps if "grad_norm:mean" in row]
    assert len(grad_norms) >= 2 and all(g > 0 for g in grad_norms), steps


def test_rl_train_async_learns_the_demo_task(stack, tmp_path):
    """The cookbook's own RL loop, tinker_cookbook.rl.train, in its async configuration: rollouts sample from
    weights up to a step behind those being trained, so the worker samples while it trains. On the demo's task
    (cookbook_words) the reward, the fraction of word tokens in a completion, must rise."""
    from tinkerq import local_models

    model_dir = local_models.resolve("tinyq-micro")
    url = stack(model_dir)
    # the demo's sizes: 8 prompts a step, 8 completions of 12 tokens each; twice its learning rate, so the reward
    # takes off within these steps
    steps, groups = 16, 8
    rows, _ = run_recipe(
        "tinker_cookbook.rl.train", url, model_dir, tmp_path, "recipe_name=tinkerq_words", "learning_rate=2e-2",
        "max_tokens=12", "lora_rank=16", "save_every=0", "eval_every=0",
        "async_config.max_steps_off_policy=1", f"async_config.groups_per_batch={groups}",
        "dataset_builder=cookbook_words:WordsDatasetBuilder", f"dataset_builder.model_name={cookbook_data.MODEL_NAME}",
        f"dataset_builder.batch_size={groups}", "dataset_builder.group_size=8", f"dataset_builder.n_batches={steps}")
    config = json.loads((tmp_path / "tinker_cookbook.rl.train-log" / "config.json").read_text())
    assert config["async_config"]["loss_fn"] == "stable_reinforce"  # the async default, left alone
    step_rows = [row for row in rows if "env/all/reward/total" in row]
    assert len(step_rows) == steps, rows
    for row in rows:
        assert all(math.isfinite(v) for v in row.values() if isinstance(v, float)), row
    # The async loop logs how many steps behind the trained weights each step's samples were: all but the first
    # step's (sampled before any training) are off-policy, and by no more than the one or two steps.
    staleness = [row["async/staleness_mean"] for row in step_rows]
    assert staleness[0] == 0 and all(s > 0 for s in staleness[1:]), staleness
    assert max(row["async/staleness_max"] for row in step_rows) <= 2, step_rows
    rewards = [row["env/all/reward/total"] for row in step_rows]
    # untrained, about a fifth of the tokens are words, and a step's mean varies by about 0.015 (sd)
    assert statistics.fmean(rewards[-3:]) > statistics.fmean(rewards[:3]) + 0.15, rewards
