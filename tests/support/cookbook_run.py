"""Runs a tinker-cookbook recipe's own entry point, unmodified, with the served model's tokenizer registered.

    python tests/support/cookbook_run.py RECIPE TOKENIZER_DIR KEY=VALUE...

RECIPE is a module under tinker_cookbook.recipes (sl_loop, rl_loop) or a whole module name whose `main` takes a
chz config (tinker_cookbook.rl.train, whose main is async); the KEY=VALUE arguments are that config, as on its
command line. Run from the directory of the local datasets (cookbook_data.write_hub_mirror).
"""

import asyncio
import importlib
import inspect
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TINKER_TELEMETRY", "0")

import chz
from tinker_cookbook.tokenizer_utils import register_tokenizer


def main(argv: list[str]) -> None:
    recipe, tokenizer_dir, *config = argv
    model_name = next(arg.split("=", 1)[1] for arg in config if arg.startswith("model_name="))

    def load_tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(tokenizer_dir)

    # The recipe asks for the tokenizer by model name; the served directory has it, the Hub is not reached.
    register_tokenizer(model_name, load_tokenizer)
    module = importlib.import_module(recipe if "." in recipe else f"tinker_cookbook.recipes.{recipe}")
    result = chz.nested_entrypoint(module.main, argv=config)
    if inspect.iscoroutine(result):
        asyncio.run(result)


if __name__ == "__main__":
    main(sys.argv[1:])
