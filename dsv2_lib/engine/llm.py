"""The public entry point: ``LLM(model).generate(prompts, SamplingParams(...))``, ``LLM.stream`` and ``LLM.logits``.

``generate`` and ``stream`` serve every prompt through the batching :class:`~dsv2_lib.engine.scheduler.Scheduler`
over a paged latent cache; which requests share a step never changes what a request generates.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from dsv2_lib.core import kernels
from dsv2_lib.core.checkpoint import load_checkpoint
from dsv2_lib.core.config import load_config
from dsv2_lib.core.dtypes import default_dtype
from dsv2_lib.core.tokenizer import Tokenizer
from dsv2_lib.engine.block_manager import PENDING, BlockManager, BlockStats
from dsv2_lib.engine.graph_runner import BUCKETS, DecodeBuffers, DecodeGraphRunner
from dsv2_lib.engine.sampling import SamplingParams, sample_rows, sample_rows_on_device
from dsv2_lib.engine.scheduler import ADMISSIONS, MODES, Scheduler, SchedulerStats, Work
from dsv2_lib.model.cache import LatentCache, PagedBatch, PagedLatentCache, SequenceBatch
from dsv2_lib.model.deepseek_v2 import DeepseekV2

EMBEDDED_MODELS = {"tiny": Path(__file__).resolve().parent.parent / "assets" / "tiny"}

Prompt = str | list[int]


@dataclass
class RequestOutput:
    """One finished request: its prompt ids, the generated ids (a final stop token included), the
    generated text (``None`` without a tokenizer) and why it stopped: ``"stop"`` or ``"length"``."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str


@dataclass(frozen=True)
class RunStats:
    """What the last ``generate``/``stream`` run did: the scheduler's and the block pool's statistics,
    the tokens generated and the wall time."""

    scheduler: SchedulerStats
    blocks: BlockStats
    generated_tokens: int
    seconds: float

    def summary(self) -> str:
        """The statistics as printed by ``python -m dsv2_lib generate --stats``."""
        s, b = self.scheduler, self.blocks
        return "\n".join([
            f"KV cache pool:          {s.pool_blocks} blocks of {s.block_size} tokens ({s.pool_blocks * s.block_size} tokens)",
            f"peak active requests:   {s.peak_running}",
            f"largest decode batch:   {s.max_decode_batch}",
            f"largest step:           {s.max_step_tokens} tokens ({s.prefill_chunks} prefill chunks in all)",
            f"peak blocks allocated:  {s.peak_used_blocks}",
            f"admission waits:        {s.admission_waits} (steps spent queued, summed over requests)",
            f"free blocks at the end: {s.free_blocks}",
            f"preemptions:            {s.preemptions}",
            f"prefill tokens:         {s.prefill_tokens} computed, {s.prefix_hit_tokens} from the prefix cache "
            f"({b.prefix_hit_blocks} block hits, {b.evictions} evictions)",
            f"steps:                  {s.steps}; {self.generated_tokens} tokens generated in {self.seconds:.2f} s",
        ])


def _check_memory_utilization(utilization: float, kv_cache_mib: float | None, device: torch.device,
                              max_num_batched_tokens: int | None) -> None:
    """Refuse a ``gpu_memory_utilization`` that is not a fraction in (0, 1], or that comes with
    ``kv_cache_mib`` (two sizes for one cache), a device other than CUDA (no GPU memory to measure) or
    no per-step token budget (the activation reserve needs a bound on the tokens of a step)."""
    if not isinstance(utilization, (int, float)) or isinstance(utilization, bool) or not 0 < utilization <= 1:
        raise ValueError(f"gpu_memory_utilization must be a fraction in (0, 1], got {utilization!r}")
    if kv_cache_mib is not None:
        raise ValueError(f"give kv_cache_mib ({kv_cache_mib}) or gpu_memory_utilization ({utilization}), not both: "
                         "each sizes the KV cache")
    if device.type != "cuda":
        raise ValueError(f"gpu_memory_utilization sizes the KV cache from a GPU's memory, but the device is "
                         f"{device.type}; use kv_cache_mib there")
    if max_num_batched_tokens is None:
        raise ValueError("gpu_memory_utilization needs max_num_batched_tokens: the memory kept for activations "
                         "follows from the most tokens one step may hold")


def resolve_model(model: str | Path) -> Path:
    """An embedded model's name (``"tiny"``) or a checkpoint directory -> the directory."""
    if str(model) in EMBEDDED_MODELS:
        return EMBEDDED_MODELS[str(model)]
    path = Path(model)
    if not path.is_dir():
        raise FileNotFoundError(f"model {str(model)!r}: not an embedded model ({', '.join(EMBEDDED_MODELS)}) nor a directory")
    return path


class LLM:
    """A DeepSeek-V2 model ready to generate.

    ``device=None`` picks CUDA when available; ``dtype=None`` picks bfloat16 on CUDA, float32 on
    the CPU. ``max_model_len`` caps prompt + generated tokens (default: the config's
    ``max_position_embeddings``).

    Serving: requests run through a scheduler (``scheduling``: ``"continuous"`` or ``"static"``;
    ``admission``: ``"reserve"`` or ``"optimistic"``, see :mod:`~dsv2_lib.engine.scheduler`) over a paged
    latent cache of blocks of ``block_size`` tokens, shared prompt prefixes computed once when
    ``prefix_caching``: within a run, and with a cache sized once (below) across runs too, since the
    pool and its cached blocks then outlive each run (:meth:`reset_prefix_cache` forgets them). A step computes at most ``max_num_batched_tokens`` tokens: decodes first, then
    prompt chunks (chunked prefill; ``None``: no limit, whole prompts). ``kv_cache_mib`` sizes the cache
    once, here (requests then wait for blocks); ``gpu_memory_utilization`` (CUDA only) sizes it once,
    after loading the weights, to what that fraction of the GPU's memory leaves
    (:meth:`PagedLatentCache.from_gpu_memory`); neither: sized at each run to hold every request's worst
    case at once. After a run, ``last_stats`` holds its :class:`RunStats`. ``cuda_graphs``: decode steps
    on a GPU (bf16/fp16) replay CUDA graphs (:class:`~dsv2_lib.engine.graph_runner.DecodeGraphRunner`); False runs
    every launch from Python (eager), for debugging and comparison. ``async_scheduling`` (with
    ``admission="reserve"``): the host plans and launches step t+1 before it reads step t's tokens
    back, so its scheduling work overlaps the GPU's (see :meth:`_run_ahead`). The tokens are those of
    one step at a time; on a GPU a step that still carries a request stopped the step before is a
    different batch, which may round differently, as any change of batch may.
    """

    def __init__(self, model: str | Path = "tiny", device: str | None = None, dtype: str | torch.dtype | None = None,
                 max_model_len: int | None = None, kv_cache_mib: float | None = None, block_size: int = 16,
                 scheduling: str = "continuous", admission: str = "reserve", prefix_caching: bool = True,
                 max_num_batched_tokens: int | None = 8192, gpu_memory_utilization: float | None = None,
                 cuda_graphs: bool = True, async_scheduling: bool = True):
        path = resolve_model(model)
        self.config = load_config(path)
        self.device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
        if dtype is None:
            dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32
        self.dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else dtype
        if self.dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be float32, float16 or bfloat16, got {dtype!r}")
        if max_model_len is not None and (not isinstance(max_model_len, int) or max_model_len < 2):
            raise ValueError(f"max_model_len must be an int >= 2 (a prompt token and a generated one), got {max_model_len!r}")
        self.max_model_len = max_model_len or self.config.max_position_embeddings
        if scheduling not in MODES or admission not in ADMISSIONS:
            raise ValueError(f"scheduling must be one of {MODES} and admission one of {ADMISSIONS}; "
                             f"got {scheduling!r} and {admission!r}")
        if not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size must be an int >= 1, got {block_size!r}")
        self.block_size, self.scheduling, self.admission = block_size, scheduling, admission
        Scheduler.check_budget(max_num_batched_tokens)
        self.prefix_caching, self.max_num_batched_tokens = prefix_caching, max_num_batched_tokens
        if gpu_memory_utilization is not None:
            _check_memory_utilization(gpu_memory_utilization, kv_cache_mib, self.device, max_num_batched_tokens)
        self.cache = None if kv_cache_mib is None else PagedLatentCache.from_mib(
            self.config, kv_cache_mib, self.dtype, self.device, block_size, self.max_model_len)
        self.last_stats: RunStats | None = None
        self.cuda_graphs, self.async_scheduling, self._runner = cuda_graphs, async_scheduling, None
        self._blocks: BlockManager | None = None  # the block pool of self.cache, kept across runs
        self._serving = False  # a run over self._blocks has started and not ended
        with torch.device(self.device), default_dtype(self.dtype):
            self.model = DeepseekV2(self.config)
        load_checkpoint(self.model, path)
        if gpu_memory_utilization is not None:  # after the weights: the pool gets what they leave
            self.cache = PagedLatentCache.from_gpu_memory(
                self.config, self.dtype, self.device, block_size, self.max_model_len, gpu_memory_utilization,
                max_num_batched_tokens)
        self.tokenizer = Tokenizer.from_dir(path)

    # ---- inputs -----------------------------------------------------------------------------
    def _token_ids(self, prompt: Prompt, index: int) -> list[int]:
        """A prompt's token ids, validated (range, length); ``index`` names it in errors."""
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"prompt {index} is text but this checkpoint has no tokenizer.json; pass token ids")
            ids = self.tokenizer.encode(prompt)
        elif isinstance(prompt, (list, tuple)):
            ids = list(prompt)
        else:
            raise ValueError(f"prompt {index} is {type(prompt).__name__} {prompt!r}; a prompt is text or a list of token ids")
        if not ids:
            raise ValueError(f"prompt {index} is empty")
        vocab = self.config.vocab_size
        if not (all(type(t) is int for t in ids) and 0 <= min(ids) and max(ids) < vocab):  # C loops; else find the culprit
            for pos, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise ValueError(f"prompt {index}: token {pos} is {t!r}, not an int (a prompt is text or a list of ints)")
                if not 0 <= t < vocab:
                    raise ValueError(f"prompt {index}: token {pos} is {t!r}, outside the vocabulary [0, {vocab})")
        if len(ids) >= self.max_model_len:
            raise ValueError(
                f"prompt {index} has {len(ids)} tokens; the context holds {self.max_model_len} "
                "(prompt plus at least one generated token)"
            )
        return ids

    # ---- public API -------------------------------------------------------------------------
    def logits(self, prompt: Prompt) -> torch.Tensor:
        """float32 logits for every position of one prompt, ``[len, vocab]`` on the CPU."""
        ids = self._token_ids(prompt, 0)
        cache = LatentCache(self.config, 1, len(ids), self.dtype, self.device)
        batch = SequenceBatch(slots=(0,), starts=(0,), lens=(len(ids),))
        hidden = self.model(torch.tensor(ids, device=self.device), batch, cache)
        return self.model.compute_logits(hidden).cpu()

    def generate(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
                 progress: bool | None = None) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids), all served together by the scheduler.

        ``progress``: a progress bar of finished requests on stderr (``None``: only on a terminal).
        """
        ids, plist = self._requests(prompts, params)
        out: list[list[int]] = [[] for _ in ids]
        finish: list[str | None] = [None] * len(ids)
        for i, token, reason in self._serve(ids, plist, progress):
            out[i].append(token)
            finish[i] = reason
        return [
            RequestOutput(i, o, self.tokenizer.decode(o) if self.tokenizer else None, f)
            for i, o, f in zip(ids, out, finish)
        ]

    def stream(self, prompts: Prompt | list[Prompt], params: SamplingParams | list[SamplingParams] | None = None,
               progress: bool | None = False) -> Iterator[tuple[int, int, str | None]]:
        """Like :meth:`generate`, but yield ``(request index, token id, text piece)`` as tokens are produced.

        A request's pieces concatenate to its final text (a piece is held back while it ends in an
        incomplete UTF-8 character); ``None`` without a tokenizer. Prompts are validated, and a request
        larger than the cache rejected, here, before the first token. With a cache sized once the runs of
        one LLM share it: consume (or ``close()``) one stream before starting another run, which is
        refused until then. No progress bar by default.
        """
        ids, plist = self._requests(prompts, params)
        return self._pieces(self._serve(ids, plist, progress), len(ids))

    # ---- serving ----------------------------------------------------------------------------
    def _requests(self, prompts, params) -> tuple[list[list[int]], list[SamplingParams]]:
        """Prompts (one, or a list) and params (one for all, or one each) -> validated token ids and params."""
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and all(isinstance(t, int) for t in prompts)):
            prompts = [prompts]
        params = SamplingParams() if params is None else params  # not `or`: an empty list is a mismatch
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(plist)} SamplingParams")
        return [self._token_ids(p, i) for i, p in enumerate(prompts)], plist

    def _serve(self, ids: list[list[int]], plist: list[SamplingParams],
               progress: bool | None) -> Iterator[tuple[int, int, str | None]]:
        """Queue every request (rejecting at once one larger than the cache), then run the scheduler to
        the end, yielding ``(request index, token, finish reason or None)`` per sampled token."""
        limits = [min(len(i) + p.max_tokens, self.max_model_len) for i, p in zip(ids, plist)]
        cache = self.cache
        if cache is None:  # room for every request's worst case (prompt + max_tokens - 1 tokens) at once
            need = max(1, sum(-(-(n - 1) // self.block_size) for n in limits))
            cache = PagedLatentCache(self.config, need, self.block_size, self.dtype, self.device, max(limits, default=0))
            blocks = BlockManager(cache.num_blocks, self.block_size, self.prefix_caching)
        else:  # one pool for the LLM's life: what earlier runs cached stays hittable
            if self._blocks is None:
                self._blocks = BlockManager(cache.num_blocks, self.block_size, self.prefix_caching)
            blocks = self._blocks
        sched = Scheduler(blocks, self.scheduling, self.admission, self.max_num_batched_tokens)
        for i, n in zip(ids, limits):  # request ids 0, 1, ... are the prompt indices
            sched.add_request(i, n - len(i))
        return self._run(sched, cache, plist, progress)

    def _run(self, sched: Scheduler, cache: PagedLatentCache, plist: list[SamplingParams],
             progress: bool | None) -> Iterator[tuple[int, int, str | None]]:
        """Step the scheduler to the end: model, one sample per work item that samples (decodes and
        prompts' last chunks) with each request's own generator, stop decisions; then record ``last_stats``.

        On the LLM's own pool one run at a time. A run that does not reach its end (an error, a stream
        closed early) may leave blocks named whose rows no step wrote, so the pool is then forgotten."""
        shared = sched.blocks is self._blocks
        if shared and self._serving:
            raise RuntimeError("this LLM's cache is in use by an unfinished stream(): consume it or close() it "
                               "before starting another run")
        self._serving, ended = shared, False
        sched.blocks.reset_counters()
        generators = [p.generator(self.device) for p in plist]
        start, generated = time.perf_counter(), 0
        ahead = self.async_scheduling and sched.admission == "reserve"
        steps = self._run_ahead if ahead else self._run_in_step
        try:
            with tqdm(total=len(plist), desc="requests", unit="req", disable=None if progress is None else not progress) as bar:
                for i, token, reason in steps(sched, cache, plist, generators, bar):
                    generated += 1
                    yield i, token, reason
            ended = True
        finally:
            if shared:
                self._serving = False
                if not ended:
                    self._blocks = None
        self.last_stats = RunStats(sched.stats(), sched.blocks.stats(), generated, time.perf_counter() - start)

    def reset_prefix_cache(self) -> None:
        """Forget the prompt blocks earlier runs left in the pool's prefix cache, so that the next run
        computes every prompt in full (to time prefill, say). Only a cache sized once (``kv_cache_mib``,
        ``gpu_memory_utilization``) keeps them across runs."""
        if self._serving:
            raise RuntimeError("reset_prefix_cache: an unfinished stream() is using the cache; consume it or close() it first")
        if self._blocks is not None:  # (None: the next run makes a new pool, empty)
            self._blocks.forget_cached()

    def _run_in_step(self, sched, cache, plist, generators, bar) -> Iterator[tuple[int, int, str | None]]:
        """One step at a time: run it, read its tokens back (the host waits), update, plan the next."""
        while sched.has_unfinished():
            work = sched.schedule()
            sampled = [w for w in work if w.samples]
            logits = self._step(work, cache) if work else None
            tokens = sample_rows(logits, [plist[w.request.id] for w in sampled],
                                 [generators[w.request.id] for w in sampled]) if sampled else []
            stops = [self._is_stop(t, plist[w.request.id]) for t, w in zip(tokens, sampled)]
            bar.update(len(sched.update(work, tokens, stops)))
            for w, t in zip(sampled, tokens):
                yield w.request.id, t, w.request.finish_reason

    def _run_ahead(self, sched, cache, plist, generators, bar) -> Iterator[tuple[int, int, str | None]]:
        """One step ahead of the GPU. Step t+1 is planned (its sampled tokens recorded as ``PENDING``)
        and launched, its decode tokens gathered on the GPU from step t's picks, before the host reads
        step t's tokens back; so the GPU runs step t+1 while the host resolves step t (stop checks,
        the placeholders, the yields) and plans step t+2. A request that stops at step t has already
        been given a token in step t+1: that token is dropped (:meth:`Scheduler.resolve`), its cache row
        lands in the request's own blocks before any later step reuses them."""
        pending = None  # (step, sampled work, picks on the GPU, picks on the host, copy done)
        while sched.has_unfinished() or pending is not None:
            launched = None
            if sched.has_unfinished():
                work = sched.schedule()
                step, sampled = sched.steps - 1, [w for w in work if w.samples]
                earlier = None if pending is None else (pending[2], {w.request.id: i for i, w in enumerate(pending[1])})
                logits = self._step(work, cache, earlier) if work else None
                if sampled:
                    picks = sample_rows_on_device(logits, [plist[w.request.id] for w in sampled],
                                                  [generators[w.request.id] for w in sampled])
                    host = torch.empty_like(picks, device="cpu", pin_memory=picks.is_cuda)
                    host.copy_(picks, non_blocking=True)
                    done = torch.cuda.Event() if picks.is_cuda else None
                    if done is not None:
                        done.record()
                    launched = (step, sampled, picks, host, done)
                bar.update(len(sched.update(work, [PENDING] * len(sampled), [False] * len(sampled))))
            if pending is not None:
                step, sampled, _, host, done = pending
                if done is not None:
                    done.synchronize()  # this step only: the one launched above keeps running
                tokens = host.tolist()
                stops = [self._is_stop(t, plist[w.request.id]) for t, w in zip(tokens, sampled)]
                report, finished = sched.resolve(sampled, tokens, stops, step)
                bar.update(len(finished))
                for r, t, last in report:
                    yield r.id, t, r.finish_reason if last else None
            pending = launched

    def _pieces(self, tokens: Iterator[tuple[int, int, str | None]], n: int) -> Iterator[tuple[int, int, str | None]]:
        """``(index, token, reason)`` -> ``(index, token, text piece)``, detokenizing incrementally."""
        out: list[list[int]] = [[] for _ in range(n)]
        sent = [""] * n
        for i, token, reason in tokens:
            out[i].append(token)
            piece = None
            if self.tokenizer is not None:
                text = self.tokenizer.decode(out[i])
                piece = "" if reason is None and text.endswith("\ufffd") else text[len(sent[i]):]
                sent[i] += piece
            yield i, token, piece

    def _step(self, work: list[Work], cache: PagedLatentCache,
              earlier: tuple[torch.Tensor, dict[int, int]] | None = None) -> torch.Tensor:
        """Run the model on one scheduled step: logits of the last token of each work item that samples,
        in work order, ``[sum(w.samples for w in work), vocab]``.

        Decode items run as a CUDA graph where :meth:`_graphs_apply` (:mod:`~dsv2_lib.engine.graph_runner`).
        A step may hold decode items and prefill chunks: each kind is one forward pass over a
        :class:`PagedBatch` of its own (``decode`` picks the attention path), the decode items first, as
        the scheduler lists them (a block a decode item fills is then written before a prefill of the
        same step that shares it reads it; see :mod:`~dsv2_lib.engine.scheduler`). ``earlier = (picks, row of
        each request)``: a token that is ``PENDING`` here is that request's pick of the step before,
        still on the GPU (:meth:`_run_ahead`).
        """
        logits = []
        for part in ([w for w in work if not w.prefill], [w for w in work if w.prefill]):
            if not part:
                continue
            ids = [t for w in part for t in w.token_ids]
            source = None  # a decode token still PENDING: row of the step before's picks (prompts are known)
            if earlier is not None and not part[0].prefill:
                source = earlier[0], [earlier[1][w.request.id] if w.token_ids[0] == PENDING else -1 for w in part]
            if not part[0].prefill and self._graphs_apply(len(part), cache):
                runner = self._graph_runner(cache)
                logits.append(runner(ids, [w.positions.start for w in part], [w.block_table for w in part],
                                     [w.slots[0] for w in part], source))
                continue
            batch = PagedBatch(
                starts=tuple(w.positions.start for w in part), lens=tuple(len(w.token_ids) for w in part),
                block_tables=tuple(w.block_table for w in part), block_size=cache.block_size,
                slots=tuple(s for w in part for s in w.slots), decode=not part[0].prefill, device=self.device,
                host_checked=True,  # prompts were checked by _token_ids, the other ids are the model's samples
            )
            tokens = batch.to_device(ids, torch.int64, self.device)
            if source is not None:
                tokens = DecodeBuffers.take_earlier(tokens, batch.to_device(source[1], torch.int64, self.device), source[0])
            last = [i - 1 for i, w in zip(itertools.accumulate(batch.lens), part) if w.samples]
            hidden = self.model(tokens, batch, cache)[batch.to_device(last, torch.int64, self.device)]
            logits.append(self.model.compute_logits(hidden))
        return logits[0] if len(logits) == 1 else torch.cat(logits)

    def _graphs_apply(self, batch_size: int, cache: PagedLatentCache) -> bool:
        """Whether a decode step of ``batch_size`` requests runs as a CUDA graph: ``cuda_graphs`` on, the
        16-bit kernel path on a GPU, and a captured size large enough."""
        return (self.cuda_graphs and self.dtype in (torch.float16, torch.bfloat16) and kernels.use_kernels(cache.rows)
                and batch_size <= max(BUCKETS))

    def _graph_runner(self, cache: PagedLatentCache) -> DecodeGraphRunner:
        """The runner of ``cache``'s graphs: kept while the cache is (with ``kv_cache_mib`` or
        ``gpu_memory_utilization``, for the LLM's life), captured again for a new one."""
        if self._runner is None or self._runner.cache is not cache:
            self._runner = DecodeGraphRunner(self.model, cache)
        return self._runner

    def _is_stop(self, token: int, params: SamplingParams) -> bool:
        return token in params.stop_token_ids or (not params.ignore_eos and token in self.config.eos_token_id)
