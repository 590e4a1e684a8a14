"""The base models a deployment serves are configured (TINKERQ_BASE_MODELS), advertised and enforced."""

import pytest
from fastapi.testclient import TestClient

from producer.api.app import create_app
from producer.api.settings import ApiSettings
from schemas import CreateModelRequest, LoraConfig
from tinkerq.catalog import BaseModelCatalog, UnknownBaseModel
from tinkerq.config import RuntimeConfig
from tinkerq.local_models import LOCAL_MODELS, PACKAGED_MODELS, resolve
from worker.runtime import DomainError
from worker.runtime.registry import build_runtime, runtime_name

KEY = {"X-API-Key": "tml-good"}


def test_unset_serves_every_built_in_model_and_entries_take_names_dirs_and_aliases(tmp_path):
    assert BaseModelCatalog.parse("").names == [*LOCAL_MODELS, *PACKAGED_MODELS]
    directory = resolve("tinyq-micro")
    catalog = BaseModelCatalog.parse(f"tinyq-tied, {directory}, Org/Alias-1B={directory}")
    assert catalog.names == ["tinyq-tied", str(directory), "Org/Alias-1B"]
    assert catalog.path("Org/Alias-1B") == directory and catalog.path(str(directory)) == directory
    with pytest.raises(UnknownBaseModel, match="tinyq-micro"):
        catalog.path("tinyq-micro")  # built in, but not served by this deployment
    with pytest.raises(ValueError, match="not an HF-format directory"):
        BaseModelCatalog.parse(f"x={tmp_path}")


def test_the_api_advertises_and_accepts_exactly_the_configured_models(r, redis_url, config):
    directory = resolve("tinyq-micro")
    catalog = BaseModelCatalog.parse(f"tinyq-micro,Org/Alias-1B={directory}")
    with TestClient(create_app(redis_url, ApiSettings(api_keys="tml-good"), config, catalog)) as api:
        listed = api.get("/api/v1/get_server_capabilities", headers=KEY).json()["supported_models"]
        assert [m["model_name"] for m in listed] == ["tinyq-micro", "Org/Alias-1B"]
        assert listed[1]["max_context_length"] == LOCAL_MODELS["tinyq-micro"].context  # read from its config
        sid = api.post("/api/v1/create_session", json={}, headers=KEY).json()["session_id"]

        def create(base: str, seq: int):
            return api.post("/api/v1/create_model", headers=KEY,
                            json={"session_id": sid, "model_seq_id": seq, "base_model": base})

        assert create("Org/Alias-1B", 0).status_code == 200
        refused = create("tinyq-small", 1)
        assert refused.status_code == 404 and "Org/Alias-1B" in refused.json()["error"]
        bare = api.post("/api/v1/create_sampling_session", headers=KEY,
                        json={"session_id": sid, "sampling_session_seq_id": 0, "base_model": "tinyq-small"})
        assert bare.status_code == 404


def test_a_worker_builds_only_the_configured_models(tmp_path, monkeypatch):
    monkeypatch.setenv("TINKERQ_BASE_MODELS", f"Org/Alias={resolve('tinyq-micro')}")
    rt = build_runtime(RuntimeConfig(runtime="torch", engine="torch", checkpoint_root=str(tmp_path)))
    rt.execute(CreateModelRequest(model_id="a:train:0", base_model="Org/Alias", lora=LoraConfig(rank=2)))
    with pytest.raises(DomainError) as refused:
        rt.execute(CreateModelRequest(model_id="b:train:0", base_model="tinyq-micro", lora=LoraConfig(rank=2)))
    assert refused.value.code == "unknown_base_model"


def test_a_worker_serves_a_real_model_unless_the_stand_in_is_asked_for(monkeypatch):
    assert runtime_name(RuntimeConfig()) == "torch"
    assert runtime_name(RuntimeConfig(runtime="reference")) == "reference"
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "peft" else real(name, *a))
    with pytest.raises(RuntimeError, match="--runtime reference"):
        runtime_name(RuntimeConfig())


def test_asking_for_gpus_on_ray_picks_the_ray_runtime_and_an_in_process_runtime_beside_it_is_refused():
    assert runtime_name(RuntimeConfig(ray_gpus=2)) == "ray"
    assert runtime_name(RuntimeConfig(runtime="ray", ray_address="auto")) == "ray"
    # TINKERQ_RUNTIME=torch with TINKERQ_RAY_GPUS=1 once ran the in-process worker without a word (gpu_rl_step)
    for runtime in ("torch", "reference"):
        with pytest.raises(ValueError, match="ask for the Ray runtime"):
            runtime_name(RuntimeConfig(runtime=runtime, ray_gpus=1))


def test_a_local_model_built_on_a_distributed_rank_other_than_0_is_whole(tmp_path, monkeypatch):
    """transformers 5 saves a checkpoint only on torch.distributed's rank 0; the Ray runtime's trainer rank 1 may be
    the first process to need a model. Its build must still hold the config and weights, and a cache an earlier
    build left marked done without them is built again rather than served."""
    import torch.distributed as dist
    from transformers import AutoConfig

    from tinkerq import local_models

    monkeypatch.setattr(local_models, "CACHE", tmp_path)
    monkeypatch.setattr(dist, "is_initialized", lambda: True)  # this process is rank 1 of a group, to transformers
    monkeypatch.setattr(dist, "get_rank", lambda group=None: 1)
    built = resolve("tinyq-tied")
    assert AutoConfig.from_pretrained(built).tie_word_embeddings and list(built.glob("*.safetensors"))

    for f in [built / "config.json", *built.glob("*.safetensors")]:  # what the earlier build left
        f.unlink()
    assert local_models.cached_dir("tinyq-tied") is None
    assert (resolve("tinyq-tied") / "config.json").exists()


@pytest.mark.parametrize("tied", [False, True])
def test_a_per_tensor_init_is_hfs_init_and_the_same_whatever_the_threads(tmp_path, monkeypatch, tied):
    """The large shapes draw each tensor from a generator seeded by its name, on every core: the files must not
    depend on how many threads drew them, and must be what HF's init gives (matrices ~ N(0, 0.02), biases 0,
    norms 1, the tie kept)."""
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from tinkerq import local_models

    shape = local_models.Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=2048,
                               tie_embeddings=tied, wide_init=False, save_dtype="bfloat16", init_dtype="bfloat16",
                               per_tensor_init=True)
    local_models.build("t", shape, tmp_path / "many")
    monkeypatch.setattr(local_models.os, "cpu_count", lambda: 1)
    local_models.build("t", shape, tmp_path / "one")
    many, one = (load_file(next((tmp_path / d).glob("*.safetensors"))) for d in ("many", "one"))
    assert many.keys() == one.keys() and all(torch.equal(many[k], one[k]) for k in many)

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "many", dtype=torch.float32)
    layer = model.model.layers[0]
    assert torch.all(layer.self_attn.q_proj.bias == 0) and torch.all(layer.input_layernorm.weight == 1)
    assert abs(layer.mlp.up_proj.weight.std().item() - 0.02) < 1e-3
    assert not torch.equal(layer.mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
    assert (model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()) == tied
    assert tied or not torch.equal(model.lm_head.weight, model.model.embed_tokens.weight)


def test_per_tensor_init_refuses_the_wide_init_it_does_not_draw():
    from tinkerq.local_models import Shape

    with pytest.raises(ValueError, match="wide_init"):
        Shape(hidden=128, layers=2, heads=4, kv_heads=2, intermediate=256, vocab=2048, per_tensor_init=True)
