"""megatron-core's optimizer CPU offload (``actor.optim.cpu_offload``, its ``HybridDeviceOptimizer`` inside the
DistributedOptimizer) at DP=2 with a bf16 actor: an update with all or half of the optimizer state on the host
gives the fp32 main weights, Adam moments and metrics of an update without it, and a checkpoint resumes into it
from a run without it, and out of it. On this CPU machine the host is the device: the parameters stand
in for device tensors while the optimizer splits them (:mod:`megarl.parallel.megatron_cpu`), so its host copies,
gradient copies, host step and copies back all run."""

from __future__ import annotations

import pytest
import torch

from megarl.models.spec import ModelSpec
from tests.distributed import run_world

# every parameter bf16 (as tests/test_checkpoint_optimizer.py); megatron's offload steps the fp32 copies of
# bf16/fp16 weights
SPEC = ModelSpec("qwen2", 1000, 96, 2, 4, 2, 24, 200, tie_word_embeddings=True)
FRACTIONS = (0.0, 1.0, 0.5)
RESUMES = ((0.5, 0.0), (0.0, 1.0))  # (the resumed run's cpu_offload, the checkpoint's): into it and out of it


def _run(rank, world, tmp):
    from megarl.config import ActorConfig, AlgorithmConfig, KLConfig, OptimConfig
    from megarl.models import checkpoint as ck
    from megarl.parallel.mesh import ParallelLayout, initialize_model_parallel
    from megarl.workers.actor import PolicyWorker
    from tests.rl_tasks import update_batch

    layout = ParallelLayout(dp=world)
    initialize_model_parallel(layout)
    batch = update_batch(8, 900, response_len=6, old_logprob=-7.0)
    alg = AlgorithmConfig(kl=KLConfig(coef=0.0))

    def worker(fraction):
        rc = ActorConfig(optim=OptimConfig(lr=1e-3, weight_decay=0.1, cpu_offload=fraction), micro_batch_size=2,
                         ppo_mini_batch_size=4)
        return PolicyWorker(SPEC, layout, "actor", "preset:random", torch.bfloat16, rc, trainable=True,
                            total_updates=4, temperature=1.0)

    def state(w):
        """fp32 main weight, Adam moments and step of each of this rank's shards, by parameter name."""
        opt = w.optimizer.chained_optimizers[0] if hasattr(w.optimizer, "chained_optimizers") else w.optimizer
        out = {}
        for name, p in w.bare.named_parameters():
            if p in opt.model_param_group_index_map:
                group, order = opt.model_param_group_index_map[p]
                step = opt.optimizer.state[opt.optimizer.param_groups[group]["params"][order]]["step"]
                tensors = opt._get_main_param_and_optimizer_states(p)
                out[name] = [tensors[k].detach().float().clone() for k in ("param", "exp_avg", "exp_avg_sq")]
                out[name].append(torch.as_tensor(step, dtype=torch.float64).clone())
        return opt.optimizer, out

    def split(inner):
        """Elements stepped on the host and on the device."""
        count = lambda opts: sum(p.numel() for o in opts for g in o.param_groups for p in g["params"])  # noqa: E731
        return count(inner.cpu_optimizers), count([inner.gpu_optimizer] if inner.gpu_optimizer else [])

    def host_bytes(inner):
        """Bytes of the host side: the CPU optimizers' fp32 parameter copies, their state, the gradient copies."""
        tensors = [p for o in inner.cpu_optimizers for g in o.param_groups for p in g["params"]]
        tensors += [t for o in inner.cpu_optimizers for st in o.state.values() for t in st.values()
                    if torch.is_tensor(t) and t.numel() > 1]
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()  # master_param: the copy again
                    for t in tensors + list(inner.cpu_copy_map_grad.values())}
        return sum(storages.values())

    res = {}
    for fraction in FRACTIONS:
        w = worker(fraction)
        metrics = w.update(batch, alg, seed=0)
        inner, res[fraction] = state(w)
        res[f"type {fraction}"] = type(inner).__name__
        if fraction:
            res[f"split {fraction}"] = split(inner)
            res[f"host bytes {fraction}"] = host_bytes(inner)
        res[f"metrics {fraction}"] = metrics
        if fraction in (0.0, 1.0):
            ck.save_checkpoint(f"{tmp}/{fraction}", w.sharded_state_dict(), {"hf_config": {}})
    # resume: offload (half) on from an offload-off checkpoint, off from an offload-on one
    for into, source in RESUMES:
        w = worker(into)
        w.load_sharded_state(ck.load_checkpoint(f"{tmp}/{source}", w.sharded_state_dict(is_loading=True)))
        res[f"loaded {into} from {source}"] = state(w)[1]
    return res


def _close(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.allclose(x, y, rtol=1e-6, atol=1e-9)
                                        for k in a for x, y in zip(a[k], b[k]))


def test_offloaded_update_and_resume_match_the_device_optimizer(tmp_path):
    from megarl.config import load_config
    from megarl.launch.memory import estimate_memory

    results = run_world(_run, 2, str(tmp_path))
    # the memory estimate: the whole shard's state off the device, its bytes on the host (as allocated, 2%)
    cfg = load_config(None, ["model.dtype=bfloat16", "actor.parallel.dp=2", "actor.optim.cpu_offload=1.0"])
    est = estimate_memory(cfg, SPEC, 2, gpu=True, device_bytes=0)
    device = estimate_memory(load_config(None, ["model.dtype=bfloat16", "actor.parallel.dp=2"]), SPEC, 2, gpu=True,
                             device_bytes=0)
    assert est.optimizer == 0 and device.host == 0 and est.total == device.total - device.optimizer
    assert est.host == pytest.approx(max(r["host bytes 1.0"] for r in results), rel=0.02)
    assert "host memory" in est.describe()
    for r in results:
        assert r["type 0.0"] == "Adam" or r["type 0.0"] == "AdamW"
        assert r["type 1.0"] == r["type 0.5"] == "HybridDeviceOptimizer"
        host, device = r["split 1.0"]
        assert host > 0 and device == 0
        host, device = r["split 0.5"]  # whole shards, in order, until half the elements are on the host
        assert device > 0 and host >= device
        assert r[0.0] and all(s[3] == 2 for s in r[0.0].values())  # two mini-batches: two Adam steps
        for fraction in (1.0, 0.5):
            assert _close(r[fraction], r[0.0]), fraction
            for got, want in zip(r[f"metrics {fraction}"], r["metrics 0.0"]):
                assert got.keys() == want.keys()
                assert got == pytest.approx(want, rel=1e-6, abs=1e-9)
        for into, source in RESUMES:
            assert _close(r[f"loaded {into} from {source}"], r[source]), (into, source)


@pytest.mark.parametrize("overrides, field", [
    (["actor.optim.cpu_offload=1.5"], "actor.optim.cpu_offload: must be in"),
    (["model.dtype=bfloat16", "actor.optim.distributed=false", "actor.optim.cpu_offload=1"], "needs distributed"),
    (["model.dtype=float32", "actor.optim.cpu_offload=1"], "actor.optim.cpu_offload: 1.0 needs model.dtype=bf"),
    (["model.dtype=float16", "critic.optim.cpu_offload=0.5"], "critic.optim.cpu_offload: 0.5 needs model.dtype"),
])
def test_bad_offload_settings_are_refused_naming_the_field(overrides, field):
    from megarl.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=field):
        load_config(None, overrides)
