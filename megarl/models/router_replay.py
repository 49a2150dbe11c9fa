"""Router replay (R3, "rollout routing replay") for mixture-of-experts models, and the routing-agreement metric.

The rollout engine and the trainer compute the same router logits only up to floating-point rounding (other
kernels, batch shapes, dtypes), so a token whose top-k scores nearly tie goes to other experts in the trainer
than in the engine: one of the main sources of rollout/trainer log-prob mismatch in MoE RL (Ma et al. 2025,
"Stabilizing MoE Reinforcement Learning by Aligning Training and Inference Routers", arXiv:2510.11370;
Megatron-LM PR #4256, NeMo-RL, SkyRL's ``rollout_expert_indices``). Replay records the top-k expert ids the
engine used for every token and MoE layer and makes the trainer's routers use them.

Routes: ``[tokens, layers, top_k]`` int16 per sample (:data:`ROUTES_DTYPE`), row ``t`` the experts that
token ``t`` of prompt + response went to in each MoE layer. The engine routes every token it runs the model
on: the prompt (prefill) and each sampled token when it is fed back, i.e. all but the last response token,
whose output nobody reads (causal attention: it changes no log-prob). In the batch (:func:`megarl.data.batch.
build_batch`) they are ``routed_experts [B, S, layers, top_k]`` in the input frame, :data:`NO_ROUTE` where the
engine routed nothing (that last token, padding).

Engine side (transformers, :class:`EngineRouteRecorder`): forward hooks on each layer's router module
(``mlp.gate``; Mixtral ``block_sparse_moe.gate``), whose third output is the top-k expert ids the HF block
dispatches with; vLLM returns the same rows itself (``enable_return_routed_experts``, converted by
:func:`megarl.rollout.vllm_engine.completion_routes`). Trainer side (:class:`RouteReplay`): megatron-core 0.19's own ``RouterReplay``
(``megatron/core/transformer/moe/router_replay.py``), one per ``TopKRouter``, in its ``REPLAY_FORWARD`` action:
the router takes the given top-k indices and gathers their scores (probabilities and gradients flow through
the replayed experts' scores as usual). Tokens without a route are sent to experts ``0 .. top_k - 1``.
megarl gives each router its instance directly and keeps it out of megatron's global instance list, whose
static setters assume one model per process (the actor and the reference policy are two).

Agreement (every step, replay on or off): per MoE layer, the share of the tokens the engine routed whose top-k
*set* that the trainer's router chooses for itself in the old-log-prob pass equals the engine's at the same
position: without replay the experts the pass dispatched to (the router's ``routing_map``); with replay the top-k
of the router's own scores, computed beside the replayed routes (megatron's top-k function, which the replay
passes over). Compared with the replayed routes themselves the share would be 1 by construction, and a replay of
routes misaligned with the tokens (shifted by one) would not show.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import torch
import torch.distributed as dist

from megarl.models.deepseek_moe import is_moe_layer
from megarl.models.spec import FAMILIES, ModelSpec

ROUTES_DTYPE = torch.int16  # expert ids (< 32768 experts)
NO_ROUTE = -1  # a token the engine did not route
ROUTES = "routed_experts"  # the batch's name of the routes, [B, S, layers, top_k]


class EngineRouteRecorder:
    """Records the top-k expert ids a transformers MoE model routes each token to, per forward.

    Args:
        model: the transformers model of ``spec`` (``model.model.layers[i].<block>.gate`` returning
            ``(logits, scores, indices [tokens, top_k])``: Qwen3-MoE, Qwen2-MoE, Mixtral in transformers 5).
        spec: its spec (an MoE one: every layer has a routed block).

    Use :meth:`recording` around the forwards, and :meth:`take` after each one.
    """

    def __init__(self, model: torch.nn.Module, spec: ModelSpec):
        block = FAMILIES[spec.family].moe.block
        self.gates = [getattr(layer, block).gate for i, layer in enumerate(model.model.layers)
                      if is_moe_layer(spec, i)]  # DeepSeek-V3's first layers are dense
        self._current: list[torch.Tensor | None] = [None] * len(self.gates)

    @contextlib.contextmanager
    def recording(self) -> Iterator["EngineRouteRecorder"]:
        """Hooks on every router while the block runs."""
        def hook(i):
            def record(module, args, output):
                self._current[i] = output[2]
            return record

        handles = [g.register_forward_hook(hook(i)) for i, g in enumerate(self.gates)]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()

    def take(self, rows: int, width: int) -> torch.Tensor:
        """The routes of the last forward, of input ``[rows, width]``: ``[rows, width, layers, top_k]`` int16.

        Raises:
            RuntimeError: a layer's router did not run since the last :meth:`take`.
        """
        if any(c is None for c in self._current):
            raise RuntimeError("a router did not run in the last forward (not recording?)")
        routes = torch.stack(self._current, dim=1).to(ROUTES_DTYPE)  # [rows * width, layers, top_k]
        self._current = [None] * len(self.gates)
        return routes.view(rows, width, *routes.shape[1:])


class RouteReplay:
    """The recorded routes of each micro-batch applied to (``replay``) and compared with (:meth:`measuring`)
    the routers of a Megatron policy's model chunks.

    :meth:`queue` takes the micro-batches of the next passes (those that ``run_microbatches`` gets, every one
    holding :data:`ROUTES`; one pass or several over the same list, e.g. the aux loss's counting pass before an
    update, :mod:`megarl.models.moe_router`); a forward pre-hook on each chunk finds the micro-batch by its
    ``input_ids`` tensor (the one ``run_microbatches`` passes; an MoE model runs without context parallelism:
    :func:`megarl.models.megatron.check_layout`), cuts its routes to what this rank's routers see and, with
    ``replay``, sets them as every router's target. A recomputed layer's router reruns inside its micro-batch's
    backward on the target of the chunk's last forward, its own with ``pp = 1`` (the config refuses
    ``recompute`` with ``pp > 1``). A forward of another input routes as usual.

    What a rank's router sees (megatron's ``[s, b]`` token order, flattened): the micro-batch's positions
    (cut to its width, or packed back to back like ``input_ids``), under sequence parallelism this TP rank's
    ``s / tp`` slice of them.

    Args:
        chunks: the rank's model chunks (``GPTModel`` s of an MoE spec, DDP-wrapped or not).
        replay: route the queued tokens to their recorded experts (``actor.moe.router_replay``).
    """

    def __init__(self, chunks: list[torch.nn.Module], *, replay: bool):
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplay

        self.replay = replay
        self.routers = [[m for m in chunk.modules() if isinstance(m, TopKRouter)] for chunk in chunks]
        self.num_layers = chunks[0].config.num_layers
        self.top_k = chunks[0].config.moe_router_topk
        self.sequence_parallel = chunks[0].config.sequence_parallel
        self.device = next(chunks[0].parameters()).device
        self._queued: dict[int, Mapping[str, torch.Tensor]] = {}  # id(input_ids) -> its micro-batch
        self._current: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # layer -> (routes [N, K], valid [N])
        self._measure = False
        self._counts = torch.zeros(self.num_layers, 2, dtype=torch.float64, device=self.device)  # agreeing, routed
        self._own: dict[int, torch.Tensor] = {}  # layer -> the top-k [N, K] its router chose itself (replay)
        for routers in self.routers:
            for router in routers:
                if replay and router.router_replay is None:
                    router.router_replay = RouterReplay()
                    RouterReplay.global_router_replay_instances.remove(router.router_replay)
                if replay:
                    self._keep_own_choice(router)
                router.register_forward_hook(self._compare)
        for c, chunk in enumerate(chunks):
            chunk.register_forward_pre_hook(
                lambda module, args, kwargs, c=c: self._start(c, args[0] if args else kwargs.get("input_ids")),
                with_kwargs=True)

    def queue(self, micro_batches: list[Mapping[str, torch.Tensor]]) -> None:
        """The micro-batches of the next passes (each with :data:`ROUTES`, ``input_ids`` and, packed,
        ``cu_seqlens`` and ``seq_offsets``), in place of the last ones."""
        self._queued = {id(mb["input_ids"]): mb for mb in micro_batches}

    @contextlib.contextmanager
    def measuring(self) -> Iterator[None]:
        """Count, per layer, the routed tokens whose experts in the passes inside agree with the engine's."""
        self._measure = True
        try:
            yield
        finally:
            self._measure = False

    def agreement(self, group=None) -> dict[str, float]:
        """The routing agreement of the passes measured since the last call, summed over ``group`` (every
        rank of it must call): ``moe/routing_agreement/layer_{i}`` (0-based) and ``moe/routing_agreement``,
        their mean over the layers; shares in [0, 1] of the tokens the engine routed (layers no token reached
        are left out; nothing when none was). Counts reset.

        Each rank counts the tokens its routers see; ranks that see the same tokens (TP without sequence
        parallelism) count every one of a layer's tokens equally often, which the share does not change.
        """
        counts = self._counts.clone()
        self._counts.zero_()
        dist.all_reduce(counts, group=group)
        layers = {i: float(a / n) for i, (a, n) in enumerate(counts.tolist()) if n > 0}
        if not layers:
            return {}
        out = {f"moe/routing_agreement/layer_{i}": v for i, v in layers.items()}
        out["moe/routing_agreement"] = sum(layers.values()) / len(layers)
        return out

    # ------------------------------------------------------------------ hooks
    def _start(self, c: int, input_ids: torch.Tensor | None) -> None:
        """Before chunk ``c``'s forward of ``input_ids``: its queued micro-batch's routes onto its routers."""
        self._current = {}
        mb = self._queued.get(id(input_ids))
        if mb is not None and mb["input_ids"] is not input_ids:
            mb = None
        wanted = mb is not None and ROUTES in mb and (self.replay or self._measure)
        routes = self._local_routes(mb) if wanted else None
        for router in self.routers[c]:
            layer = router.layer_number - 1
            if router.router_replay is not None:
                router.router_replay.clear_router_replay_action()
            if routes is None:
                continue
            valid = routes[:, layer, 0] >= 0
            fill = torch.arange(self.top_k, device=routes.device).expand(routes.shape[0], -1)
            target = torch.where(valid.unsqueeze(1), routes[:, layer].long(), fill)
            self._current[layer] = (target, valid)
            if self.replay:
                from megatron.core.transformer.moe.router_replay import RouterReplayAction

                router.router_replay.clear_indices()
                router.router_replay.set_target_indices(target)
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def _keep_own_choice(self, router) -> None:
        """Wrap ``router``'s replay so that, while measuring a replayed forward, the top-k experts the router
        would choose itself (megatron's top-k function on the scores the replay gathers from) are kept for
        :meth:`_compare`."""
        from megatron.core.transformer.moe.router_replay import RouterReplayAction

        replay = router.router_replay
        replay_topk = replay.get_replay_topk

        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
            if self._measure and replay.router_replay_action == RouterReplayAction.REPLAY_FORWARD:
                self._own[router.layer_number - 1] = default_compute_topk(scores, topk, num_groups, group_topk)[1]
            return replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)

        replay.get_replay_topk = get_replay_topk

    def _compare(self, router, args, output) -> None:
        """After a router's forward: count its tokens whose own experts (``routing_map [N, E]``, or under replay
        the top-k it chose itself) are the engine's at the same position."""
        layer = router.layer_number - 1
        own = self._own.pop(layer, None)
        if not self._measure or layer not in self._current:
            return
        target, valid = self._current[layer]
        routing_map = output[1].bool()
        if own is not None:
            routing_map = torch.zeros_like(routing_map).scatter_(1, own.to(routing_map.device), True)
        engine = torch.zeros_like(routing_map, dtype=torch.bool).scatter_(1, target, True)
        agree = (routing_map == engine).all(dim=1) & valid
        self._counts[layer, 0] += agree.sum()
        self._counts[layer, 1] += valid.sum()

    def _local_routes(self, mb: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """``[N, layers, top_k]`` routes of the tokens this rank's routers see, in their order."""
        routes = mb[ROUTES]
        width = mb["input_ids"].shape[1]
        if "seq_offsets" in mb:  # packed: the rows' tokens back to back, as pack_rows lays out input_ids
            bounds = mb["cu_seqlens"][:len(mb["seq_offsets"]) + 1].tolist()
            rows = [routes[i, :hi - lo] for i, (lo, hi) in enumerate(zip(bounds, bounds[1:]))]
            rows.append(routes.new_full((width - bounds[-1], *routes.shape[2:]), NO_ROUTE))
            routes = torch.cat(rows).unsqueeze(0)
        else:
            routes = routes[:, :width]
        routes = routes.transpose(0, 1)  # [s, b, layers, top_k]: megatron's token order
        if self.sequence_parallel:
            from megatron.core import parallel_state as ps

            tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
            part = routes.shape[0] // tp
            routes = routes[rank * part:(rank + 1) * part]
        return routes.reshape(-1, *routes.shape[2:])


def routes_of_samples(routes: Sequence[torch.Tensor | None], seq_len: int) -> torch.Tensor | None:
    """The batch's :data:`ROUTES` tensor ``[B, seq_len, layers, top_k]`` int16 from each sample's ``[tokens,
    layers, top_k]`` routes (prompt + response tokens from position 0), :data:`NO_ROUTE` elsewhere; None when
    no sample has routes (a dense model, or an engine that records none).

    Raises:
        ValueError: some samples with routes and some without, routes of different ``[layers, top_k]``, or
            longer than ``seq_len``.
    """
    if all(r is None for r in routes):
        return None
    shape = next(tuple(r.shape[1:]) for r in routes if r is not None)
    out = torch.full((len(routes), seq_len, *shape), NO_ROUTE, dtype=ROUTES_DTYPE)
    for i, r in enumerate(routes):
        if r is None or tuple(r.shape[1:]) != shape or r.shape[0] > seq_len:
            raise ValueError(f"sample {i}'s routes are {None if r is None else tuple(r.shape)}; every sample needs "
                             f"[tokens <= {seq_len}, {shape[0]}, {shape[1]}]")
        out[i, :r.shape[0]] = r
    return out
