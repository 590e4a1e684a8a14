"""The worker's default for torch's CUDA allocator (expandable segments), and an operator's own setting winning."""

import os

import pytest

from tinkerq.config import RuntimeConfig
from worker.ray_runtime import cluster
from worker.runtime import cuda_allocator
from worker.runtime.registry import build_runtime


@pytest.fixture
def clean_env(monkeypatch):
    for name in cuda_allocator.ALLOC_CONF_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


def test_without_a_setting_the_worker_asks_for_expandable_segments(clean_env):
    assert cuda_allocator.configure() == ("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_where_torch_is_imported_its_allocator_takes_the_setting_too(clean_env):
    """torch may have read the environment when it was imported: the live setting is written as well."""
    import torch

    before = torch._C._accelerator_getAllocatorSettings()
    try:
        torch._C._accelerator_setAllocatorSettings("expandable_segments:False")
        cuda_allocator.configure()
        assert torch._C._accelerator_getAllocatorSettings() == "expandable_segments:True"
    finally:
        torch._C._accelerator_setAllocatorSettings(before)


@pytest.mark.parametrize("name", cuda_allocator.ALLOC_CONF_VARS)
def test_an_operators_setting_is_kept(clean_env, name):
    clean_env.setenv(name, "max_split_size_mb:512")
    assert cuda_allocator.configure() == (name, "max_split_size_mb:512")
    assert {n: os.environ.get(n) for n in cuda_allocator.ALLOC_CONF_VARS} == {
        n: ("max_split_size_mb:512" if n == name else None) for n in cuda_allocator.ALLOC_CONF_VARS}


def test_building_a_runtime_sets_it_before_any_runtime_starts(clean_env, tmp_path):
    build_runtime(RuntimeConfig(runtime="reference", checkpoint_root=str(tmp_path)))
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"


def test_ray_actors_get_the_allocator_setting_with_the_worker_settings():
    env = cluster.actor_env({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True", "TINKERQ_DEVICE": "cuda",
                             "HOME": "/root", "PYTHONPATH": "/src"})
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert env["TINKERQ_DEVICE"] == "cuda" and env["PYTHONPATH"] == "/src"
    assert "HOME" not in env
