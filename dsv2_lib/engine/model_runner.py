"""The model's side of a step: the scheduler's :class:`~dsv2_lib.engine.scheduler.Work` in, the logits of
the positions that sample out, through the model on the paged latent cache: a step whose tokens fit a
captured CUDA graph as one replay, prompt chunks included. The loop around it (sampling, stops, the
scheduler) is :mod:`~dsv2_lib.engine.step_loop`'s."""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from dsv2_lib.core import kernels
from dsv2_lib.engine.block_manager import PENDING
from dsv2_lib.engine.engine_config import EngineConfig
from dsv2_lib.engine.graph_runner import BUCKETS, DecodeBuffers, DecodeGraphRunner, bucket
from dsv2_lib.engine.scheduler import Work
from dsv2_lib.model.cache import PagedBatch, PagedLatentCache
from dsv2_lib.model.deepseek_v2 import DeepseekV2


@dataclass(frozen=True)
class GraphEntries:
    """A step laid out as CUDA-graph entries, one per token (:func:`graph_entries`)."""

    token_ids: list[int]
    starts: list[int]  # each token's position
    block_tables: list[tuple[int, ...]]  # its request's table
    slots: list[int]  # the cache row it writes
    sources: list[int]  # row of the step before's picks that gives the token (one step ahead), else -1
    samples: list[int]  # the entry of each item that samples (its last token), in work order


def graph_entries(work: list[Work], earlier_rows: dict[int, int] | None = None) -> GraphEntries:
    """Every token of ``work`` as an entry of its own, in work order: a decode item is one entry, a
    prompt chunk of ``n`` tokens is ``n`` entries at consecutive positions sharing its request's table.
    ``earlier_rows``: each request's row in the step before's picks, for decode tokens still ``PENDING``."""
    e = GraphEntries([], [], [], [], [], [])
    for w in work:
        for token, position, slot in zip(w.token_ids, w.positions, w.slots):
            pending = earlier_rows is not None and not w.prefill and token == PENDING
            e.token_ids.append(token)
            e.starts.append(position)
            e.block_tables.append(w.block_table)
            e.slots.append(slot)
            e.sources.append(earlier_rows[w.request.id] if pending else -1)
        if w.samples:
            e.samples.append(len(e.token_ids) - 1)
    return e


class ModelRunner:
    """Runs ``model`` as ``engine_config`` says, on ``cache`` and the CUDA graphs captured on it.

    ``cache``: the cache sized once (``kv_cache_mib`` or ``gpu_memory_utilization``), which then serves
    every run; ``None``: each run gets one of its own (:meth:`cache_for`). ``last_graph``: ``(entries,
    graph size)`` when the last step (or its decode items) ran as a CUDA graph, else ``None``.
    """

    def __init__(self, model: DeepseekV2, engine_config: EngineConfig, cache: PagedLatentCache | None = None):
        self.model, self.engine_config, self.cache = model, engine_config, cache
        self._graphs: DecodeGraphRunner | None = None
        self.last_graph: tuple[int, int] | None = None

    def cache_for(self, limits: list[int]) -> PagedLatentCache:
        """The cache of a run whose requests reach at most ``limits`` tokens each: ``cache`` when sized
        once, else a new one with room for every request's worst case (``limit - 1`` rows) at once."""
        if self.cache is not None:
            return self.cache
        c = self.engine_config
        need = max(1, sum(-(-(n - 1) // c.block_size) for n in limits))
        return PagedLatentCache(self.model.cfg, need, c.block_size, c.dtype, c.device, max(limits, default=0))

    def step(self, work: list[Work], cache: PagedLatentCache,
             earlier: tuple[torch.Tensor, dict[int, int]] | None = None) -> torch.Tensor:
        """Run the model on one scheduled step: logits of the last token of each work item that samples,
        in work order, ``[sum(w.samples for w in work), vocab]``.

        A step whose tokens fit the largest CUDA graph (:meth:`_graphs_apply`) runs as one replay, every
        token an entry of its own, prompt chunks included (:func:`graph_entries`): a chunk's token at
        position ``p`` attends over the cache's first ``p + 1`` rows, written by the same replay before
        anything reads them, which is causal attention on the absorbed path of decode. A larger step
        runs its decode items as a graph where one applies and its prefill chunks eagerly, each kind one
        forward pass over a :class:`PagedBatch` of its own (``decode`` picks the attention path), the
        decode items first, as the scheduler lists them (a block a decode item fills is then written
        before a prefill of the same step that shares it reads it; see :mod:`~dsv2_lib.engine.scheduler`).
        ``earlier = (picks, row of each request)``: a token that is ``PENDING`` here is that request's
        pick of the step before, still on the GPU (:mod:`~dsv2_lib.engine.step_loop`, one step ahead).
        """
        device = self.engine_config.device
        logits, self.last_graph = [], None
        if work and self._graphs_apply(sum(len(w.token_ids) for w in work), cache):
            return self._graph_step(work, cache, earlier)
        for part in ([w for w in work if not w.prefill], [w for w in work if w.prefill]):
            if not part:
                continue
            if not part[0].prefill and self._graphs_apply(len(part), cache):
                logits.append(self._graph_step(part, cache, earlier))
                continue
            ids = [t for w in part for t in w.token_ids]
            source = None  # a decode token still PENDING: row of the step before's picks (prompts are known)
            if earlier is not None and not part[0].prefill:
                source = earlier[0], [earlier[1][w.request.id] if w.token_ids[0] == PENDING else -1 for w in part]
            batch = PagedBatch(
                starts=tuple(w.positions.start for w in part), lens=tuple(len(w.token_ids) for w in part),
                block_tables=tuple(w.block_table for w in part), block_size=cache.block_size,
                slots=tuple(s for w in part for s in w.slots), decode=not part[0].prefill, device=device,
                host_checked=True,  # prompts were checked by LLM._token_ids, the other ids are the model's samples
            )
            tokens = batch.to_device(ids, torch.int64, device)
            if source is not None:
                tokens = DecodeBuffers.take_earlier(tokens, batch.to_device(source[1], torch.int64, device), source[0])
            last = [i - 1 for i, w in zip(itertools.accumulate(batch.lens), part) if w.samples]
            hidden = self.model(tokens, batch, cache)[batch.to_device(last, torch.int64, device)]
            logits.append(self.model.compute_logits(hidden))
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _graph_step(self, work: list[Work], cache: PagedLatentCache,
                    earlier: tuple[torch.Tensor, dict[int, int]] | None) -> torch.Tensor:
        """The whole step as one replay of the graph whose size holds its tokens (:func:`graph_entries`)."""
        entries = graph_entries(work, None if earlier is None else earlier[1])
        runner = self._graph_runner(cache)
        n = len(entries.token_ids)
        self.last_graph = n, bucket(n, runner.buckets)
        logits = runner(entries.token_ids, entries.starts, entries.block_tables, entries.slots,
                        None if earlier is None else (earlier[0], entries.sources))
        if entries.samples == list(range(n)):  # decode items only: every entry samples
            return logits
        return logits[PagedBatch.to_device(entries.samples, torch.int64, logits.device)]

    def _graphs_apply(self, tokens: int, cache: PagedLatentCache) -> bool:
        """Whether ``tokens`` entries (a decode token each, or a prompt chunk's tokens) run as a CUDA
        graph: ``cuda_graphs`` on, the 16-bit kernel path on a GPU, and a captured size large enough."""
        c = self.engine_config
        return (c.cuda_graphs and c.dtype in (torch.float16, torch.bfloat16) and kernels.use_kernels(cache.rows)
                and tokens <= max(BUCKETS))

    def _graph_runner(self, cache: PagedLatentCache) -> DecodeGraphRunner:
        """The runner of ``cache``'s graphs: kept while the cache is (``cache`` sized once: for the runner's
        life), captured again for a new one."""
        if self._graphs is None or self._graphs.cache is not cache:
            self._graphs = DecodeGraphRunner(self.model, cache)
        return self._graphs
