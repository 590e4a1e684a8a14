"""Local stand-ins for what tinker-cookbook's recipes fetch from the Hub, so they run unmodified and offline.

`datasets.load_dataset(name)` loads a local directory of that name when there is one (relative to the working
directory), so a recipe run from `root` reads `root/HuggingFaceH4/no_robots` and `root/openai/gsm8k`, laid out
as those Hub repositories are (a README's `configs` names gsm8k's `main` config). The tokenizer is the served
model's own, registered under the model's name with the cookbook's `register_tokenizer` (cookbook_run.py).
"""

import json
import os
import random
import shutil
from pathlib import Path

# Served under a name the cookbook knows (model_info: a base model whose renderer is role_colon), as an operator
# would serve a local directory under the name a recipe expects (TINKERQ_BASE_MODELS="name=path").
MODEL_NAME = "Qwen/Qwen3-8B-Base"
GUESSER_VERSION = 1  # bump when boxed_guesser changes
QUESTION_SUFFIX = " Provide a numerical answer without units, written inside \\boxed{}."  # rl_loop's
# rl_loop's one-shot example, which it puts before every question.
SHOT = [
    {"role": "user", "content": "How many r's are in strawberry?" + QUESTION_SUFFIX},
    {"role": "assistant", "content": "Let's spell the word out and number all the letters: 1) s 2) t 3) r 4) a "
                                     "5) w 6) b 7) e 8) r 9) r 10) y. We have r's at positions 3, 8, and 9. "
                                     "\\boxed{3}"},
]
SL_CONVERSATIONS = [
    ("Name a color of the sky.", "The sky is blue on a clear day."),
    ("What do cats drink?", "Cats drink water and sometimes milk."),
    ("Count to five.", "One, two, three, four, five."),
    ("Say hello in French.", "Bonjour is hello in French."),
]


def _jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def sums(n: int, seed: int = 0) -> list[tuple[str, int]]:
    """Questions whose answers are one digit, so a policy that guesses a digit is right about one time in ten:
    rl_loop's groups then have rewards that differ (it skips a group whose advantages are all zero)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        a = rng.randint(0, 9)
        b = rng.randint(0, 9 - a)
        out.append((f"What is {a} plus {b}?", a + b))
    return out


def write_hub_mirror(root: Path, sl_rows: int, rl_rows: int) -> Path:
    """No Robots (`messages` chat rows) and GSM8K's `main` config (`question`, `answer` ending `#### N`)."""
    chats = [SL_CONVERSATIONS[i % len(SL_CONVERSATIONS)] for i in range(sl_rows)]
    _jsonl(root / "HuggingFaceH4/no_robots/data/train.jsonl",
           [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in chats])
    gsm8k = root / "openai/gsm8k"
    _jsonl(gsm8k / "main/train.jsonl",
           [{"question": q, "answer": f"{q} The answer is {n}.\n#### {n}"} for q, n in sums(rl_rows)])
    (gsm8k / "README.md").write_text(
        "---\nconfigs:\n- config_name: main\n  data_files:\n  - split: train\n    path: main/train.jsonl\n---\n")
    return root


def boxed_guesser(source: Path, out: Path, steps: int = 60, seed: int = 0) -> Path:
    """`source` (a random-weight tiny model) fine-tuned to answer rl_loop's prompts as `\\boxed{d}` with a random
    digit d: the base a recipe's RL assumes, one that knows the answer format, here with no knowledge of sums."""
    import torch
    from tinker_cookbook import renderers
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    rng = random.Random(seed)
    tokenizer = AutoTokenizer.from_pretrained(str(source))
    renderer = renderers.get_renderer("role_colon", tokenizer)
    model = AutoModelForCausalLM.from_pretrained(str(source), dtype=torch.float32)
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    questions = [q for q, _ in sums(64, seed=seed + 1)]
    for _ in range(steps):
        rows = []
        for question in rng.sample(questions, 8):
            prompt = renderer.build_generation_prompt([*SHOT, {"role": "user", "content": question + QUESTION_SUFFIX}])
            answer = tokenizer.encode(f" \\boxed{{{rng.randint(0, 9)}}}\n\nUser:", add_special_tokens=False)
            rows.append((prompt.to_ints(), answer))
        width = max(len(p) + len(a) for p, a in rows)
        ids = torch.full((len(rows), width), tokenizer.pad_token_id)
        labels = torch.full((len(rows), width), -100)
        for i, (prompt, answer) in enumerate(rows):
            ids[i, :len(prompt) + len(answer)] = torch.tensor(prompt + answer)
            labels[i, len(prompt):len(prompt) + len(answer)] = torch.tensor(answer)  # the answer only
        loss = model(input_ids=ids, labels=labels).loss  # right padding: causal, and its labels are -100
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    partial = out.with_name(out.name + f".partial-{os.getpid()}")
    model.save_pretrained(str(partial))
    tokenizer.save_pretrained(str(partial))
    try:
        partial.rename(out)  # whole or absent: a later session reuses it (cached_guesser)
    except OSError:  # another process renamed its build there first: same seed, same model
        shutil.rmtree(partial)
    return out


def cached_guesser() -> Path:
    """boxed_guesser over tinyq-micro, built once per machine next to the built-in local models."""
    from tinkerq import local_models

    out = local_models.CACHE / f"cookbook-boxed-guesser-v{GUESSER_VERSION}"
    if not (out / "config.json").is_file():
        boxed_guesser(local_models.resolve("tinyq-micro"), out)
    return out
