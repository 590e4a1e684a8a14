"""The RL demo's task (commands/rl_demo.py) as a tinker-cookbook RL environment, for the cookbook's own training loop.

Make a tiny random model speak in words: a prompt is the first tokens of a line of the local corpus, a completion
runs to max_tokens (no stop sequence), and its reward is the fraction of its tokens that are alphabetic words.
Groups of completions share a prompt, so the cookbook centers rewards within a group, as the demo does.

The builder is named on the cookbook's command line (`dataset_builder=cookbook_words:WordsDatasetBuilder`); the
tokenizer is the one registered under the served model's name (cookbook_run.py), so nothing reaches the Hub.
"""

import functools
import random
from collections.abc import Sequence
from dataclasses import dataclass

import chz
import tinker
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerq.local_models import corpus


@functools.cache
def word_tokens(model_name: str) -> tuple[bool, ...]:
    """For each token id: whether the token, stripped of spaces, is an alphabetic word (the demo's test)."""
    tokenizer = get_tokenizer(model_name)
    return tuple(tokenizer.decode([i]).strip().isalpha() for i in range(len(tokenizer)))


def word_fraction(tokens: Sequence[int], is_word: Sequence[bool]) -> float:
    return sum(is_word[t] for t in tokens) / len(tokens) if tokens else 0.0


class WordsEnv(Env):
    """One completion of a prompt; done after one step."""

    def __init__(self, prompt: Sequence[int], is_word: Sequence[bool]):
        self.prompt = list(prompt)
        self.is_word = is_word

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        return tinker.ModelInput.from_ints(self.prompt), []  # no stop sequence: every completion has max_tokens

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        return StepResult(reward=word_fraction(action, self.is_word), episode_done=True,
                          next_observation=tinker.ModelInput.empty(), next_stop_condition=[])


@dataclass(frozen=True)
class WordsGroupBuilder(EnvGroupBuilder):
    """group_size completions of one prompt. Holds names and token ids only, so it pickles (the cookbook's rule)."""

    prompt: tuple[int, ...]
    model_name: str
    group_size: int

    async def make_envs(self) -> Sequence[Env]:
        is_word = word_tokens(self.model_name)
        return [WordsEnv(self.prompt, is_word) for _ in range(self.group_size)]

    def logging_tags(self) -> list[str]:
        return ["words"]


class WordsDataset(RLDataset):
    def __init__(self, groups: list[WordsGroupBuilder], batch_size: int):
        self.groups = groups
        self.batch_size = batch_size

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.groups[index * self.batch_size:(index + 1) * self.batch_size]

    def __len__(self) -> int:
        return len(self.groups) // self.batch_size


@chz.chz
class WordsDatasetBuilder(RLDatasetBuilder):
    model_name: str
    batch_size: int  # groups (prompts) a batch
    group_size: int  # completions a prompt
    n_batches: int
    prompt_tokens: int = 8  # the demo's prompt length
    seed: int = 0

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        tokenizer = get_tokenizer(self.model_name)
        rng, lines = random.Random(self.seed), corpus(self.seed + 1, 500)
        groups = [WordsGroupBuilder(tuple(tokenizer(rng.choice(lines))["input_ids"][:self.prompt_tokens]),
                                    self.model_name, self.group_size)
                  for _ in range(self.n_batches * self.batch_size)]
        return WordsDataset(groups, self.batch_size), None
