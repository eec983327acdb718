"""EngineCore: the synchronous step loop. Requests in, new tokens out.

One `step()`: the scheduler plans the running set, the runner executes it as one ragged forward, the
requests whose tokens are all cached get a sampled next token, and finished requests (EOS, stop string,
max_new_tokens, abort) free their memory.
"""

from __future__ import annotations

import logging
import numbers
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.default_model import default_model_dir
from engine.tokenizer import IncrementalDetokenizer, Tokenizer, find_stop, stop_holdback
from scheduler.memory import MemoryManager
from scheduler.request import Request, RequestStats
from scheduler.scheduler import Scheduler
from scheduler.types import InvalidRequest, SamplingParams
from workers.cache import ModelCache
from workers.config import ModelConfig
from workers.footprint import Footprint, model_footprint, mtp_footprint
from engine.executor import EXECUTORS, WorkerSpec, create_executor

log = logging.getLogger("hybridspec.engine")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEVICES = ("cpu", "cuda")


@dataclass
class EngineConfig:
    model: str | None = None  # model directory; None = the embedded default model
    device: str = "cpu"
    dtype: str = "float32"
    page_size: int = 16
    # None: enough for max_running requests of max_model_len tokens (capped); with expert_parallel, the total over the
    # ranks (each holds the pages of the requests it runs: an equal share)
    num_pages: int | None = None
    max_running: int = 64  # also the number of GDN state slots
    max_step_tokens: int = 2048  # per-step token budget (chunked prefill)
    max_model_len: int | None = None  # None: the model's max_position_embeddings (capped at 32768)
    executor: str = "local"  # where the worker runs: "local" (this process) or "ray" (a Ray actor)
    spec: str = "off"  # drafter: off | ngram | draft | replay
    policy: str = "fixed"  # ar | fixed | budget | hybridspec
    max_verify_len: int = 16  # most drafted tokens one request verifies in a step
    draft_model: str | None = None
    replay_acceptance: float = 0.85
    cuda_graphs: bool = True  # decode and verification steps in CUDA graphs (CUDA only; captured per bucket)
    expert_parallel: int = 1  # > 1 with executor "ray": experts sharded over this many workers
    # start-up profile of the latency model (ModelRunner.profile) for the learned policies; None = on CUDA only
    startup_profile: bool | None = None
    # the started worker's heap frozen out of Python's cyclic GC (engine/executor.py freeze_heap: no full walk of
    # the start-up objects inside a served step); None = on CUDA only (it freezes the whole process's objects of
    # the moment: an in-process LLM on CPU leaves its caller's heap alone)
    freeze_heap: bool | None = None

    def validate(self) -> "EngineConfig":
        if not isinstance(self.device, str) or (self.device not in DEVICES and not self.device.startswith("cuda:")):
            raise ValueError(f"device must be one of {DEVICES} (or cuda:N), got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValueError(f"device {self.device!r} was asked for but torch sees no CUDA device")
        for name in ("model", "draft_model"):
            value = getattr(self, name)  # None: the embedded default model (model) / the spec's default (draft_model)
            if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value).strip()):
                raise ValueError(f"{name} must be a model directory path or None, got {value!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {tuple(DTYPES)}, got {self.dtype!r}")
        if self.executor not in EXECUTORS:
            raise ValueError(f"executor must be one of {EXECUTORS}, got {self.executor!r}")
        for name, optional in (("page_size", False), ("max_running", False), ("max_step_tokens", False),
                               ("num_pages", True), ("max_model_len", True), ("expert_parallel", False)):
            value = getattr(self, name)
            if optional and value is None:
                continue  # the engine sizes it
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                allowed = "an integer >= 1" + (" or None (the engine's default)" if optional else "")
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
        for name, optional in (("cuda_graphs", False), ("startup_profile", True), ("freeze_heap", True)):
            value = getattr(self, name)
            if not isinstance(value, bool) and not (optional and value is None):
                allowed = "True, False or None (the device's default)" if optional else "True or False"
                raise ValueError(f"{name} must be {allowed}, got {value!r}")
        return self


@dataclass
class StepOutput:
    request_id: str
    new_token_ids: list[int]
    new_text: str
    finished: bool
    finish_reason: str | None = None
    stats: RequestStats | None = None
    draft_tokens: int = 0  # drafts verified for this request in this step
    accepted_tokens: int = 0  # of those, accepted


@dataclass
class _Live:
    """Engine-side state of a request beside the scheduler's Request: its detokenization."""

    request: Request
    detok: IncrementalDetokenizer
    text: str = ""  # text decoded so far (stop strings are searched here)
    emitted_chars: int = 0


GIB = 1 << 30


def _size(n: int) -> str:
    return f"{n / GIB:.1f} GiB" if n >= GIB else f"{n / (1 << 20):.1f} MiB"


def plan_kv_pages(free: int, total: int, wanted: int, page_size: int, max_running: int, max_model_len: int,
                  target: Footprint, drafter: Footprint | None = None, drafter_slots: int = 0,
                  device: str = "cuda", share_of: int | None = None) -> int:
    """KV pages for a GPU with `free` of `total` bytes free before the worker starts: at most `wanted`, within what
    is left after the target's weights (one expert-parallel rank's) and its max_running + 1 GDN slots, a drafter's
    weights, slots and its own KV per page, and a reserve (max(4 GiB, 10% of the card)) for activations, logits,
    CUDA graphs and the allocator's slack. Raises ValueError when the weights do not fit, or when what is left holds
    less than one request of max_model_len tokens. share_of: the engine's max_running where max_running is one
    expert-parallel rank's share of it (the messages say so)."""
    reserve = max(4 * GIB, total // 10)
    weights = target.weight_bytes + (drafter.weight_bytes if drafter is not None else 0)
    state = (max_running + 1) * target.state_bytes_per_slot
    page_bytes = target.kv_bytes_per_token * page_size
    if drafter is not None:
        state += drafter_slots * drafter.state_bytes_per_slot
        page_bytes += drafter.kv_bytes_per_token * page_size
    page_bytes = max(page_bytes, 1)
    if weights + reserve > free:
        parts = f"{_size(target.weight_bytes)}" + (f" + {_size(drafter.weight_bytes)} for the drafter"
                                                    if drafter is not None else "")
        raise ValueError(
            f"{device} has {_size(free)} free: the weights need {parts} and activations / CUDA graphs "
            f"{_size(reserve)}: spread the experts over more GPUs (expert_parallel with executor 'ray')"
            f"{', run without the drafter (spec off)' if drafter is not None else ''} or use a card with more memory")
    room = free - weights - state - reserve
    one_request = -(-max_model_len // page_size)
    if room < one_request * page_bytes:
        raise ValueError(
            f"{device} has {_size(free)} free: the weights need {_size(weights)}, the GDN state of "
            + (f"max_running {max_running}" if share_of is None else
               f"{max_running} (this rank's share of max_running {share_of})")
            + f" requests {_size(state)} and activations / CUDA graphs {_size(reserve)}, which leaves "
            f"{_size(max(room, 0))} of KV, less than one request of max_model_len {max_model_len} tokens needs "
            f"({_size(one_request * page_bytes)}): lower max_model_len or max_running, or spread the experts over "
            f"more GPUs (expert_parallel)")
    return max(1, min(wanted, room // page_bytes))


class EngineCore:
    def __init__(self, config: EngineConfig):
        self.config = config.validate()
        model_dir = Path(config.model) if config.model is not None else default_model_dir()
        self.model_dir = model_dir
        self.model_config = ModelConfig.from_dir(model_dir)
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.eos_ids = set(self.model_config.eos_token_ids) | set(self.tokenizer.eos_token_ids)
        dtype, device = DTYPES[config.dtype], torch.device(config.device)
        longest = self.model_config.max_position_embeddings
        if config.max_model_len is not None and config.max_model_len > longest:
            # positions past the model's own limit were never trained (and rotary tables may not reach them)
            raise ValueError(f"max_model_len must be at most the model's max_position_embeddings ({longest}, "
                             f"{model_dir / 'config.json'}) or None, got {config.max_model_len}")
        self.max_model_len = int(config.max_model_len) if config.max_model_len is not None else min(longest, 32768)
        # expert parallelism: each rank holds the KV pages and GDN slots of the requests it runs (attention/GDN run
        # data-parallel), so the pools are partitioned, one partition per rank (scheduler/memory.py)
        parts = int(config.expert_parallel) if config.executor == "ray" else 1
        if config.max_running < parts:  # a rank with no slot would run every step with nothing to do
            raise ValueError(f"max_running must be at least expert_parallel ({parts}: each rank runs its own "
                             f"requests), got {config.max_running}")
        slots = -(-config.max_running // parts)  # a rank's GDN slots (at most max_running run at once)
        if config.num_pages is not None:  # the total over the ranks
            if config.num_pages < parts:
                raise ValueError(f"num_pages must be at least expert_parallel ({parts}: each rank holds its own "
                                 f"pages) or None (the engine's default), got {config.num_pages}")
            num_pages = int(config.num_pages) // parts  # a rank's pages
            if num_pages * parts != config.num_pages:
                log.warning("num_pages %d is not a multiple of expert_parallel %d: each rank holds %d pages (%d in "
                            "all)", config.num_pages, parts, num_pages, num_pages * parts)
        else:
            num_pages = self._auto_num_pages(dtype, device, slots)
        self.memory = MemoryManager(num_pages * parts, config.page_size, slots * parts, parts)
        self.memory_tokens = num_pages * config.page_size  # the most tokens one request can ever hold
        speculating = config.spec != "off" and config.policy != "ar"
        if config.spec != "off" and config.policy == "ar":  # (allowed: a drafter loaded, ar's baseline beside it)
            log.warning("policy 'ar' verifies no drafts: the %r drafter is loaded but never drafts "
                        "(another policy speculates: fixed, budget, hybridspec)", config.spec)
        self.scheduler = Scheduler(self.memory, config.max_running, config.max_step_tokens, self.max_model_len,
                                   max_draft=config.max_verify_len if speculating else 0)
        self.executor = create_executor(config.executor, WorkerSpec(
            str(model_dir), config.dtype, config.device, num_pages, config.page_size, slots,
            spec=config.spec, policy=config.policy, max_verify_len=config.max_verify_len, draft_model=config.draft_model,
            replay_acceptance=config.replay_acceptance, expert_parallel=config.expert_parallel,
            startup_profile=(config.startup_profile if config.startup_profile is not None
                             else config.device.startswith("cuda"))
            and speculating and config.policy in ("budget", "hybridspec"),
            freeze_heap=config.freeze_heap if config.freeze_heap is not None else config.device.startswith("cuda"),
            graph_pages_per_request=-(-self.max_model_len // config.page_size) if config.cuda_graphs else 0))
        self.live: dict[str, _Live] = {}
        # an abort that arrives while a step runs (a stream's cleanup run by the garbage collector inside it) waits
        # for the step's end: the step reads self.live of every request it planned
        self._stepping = False
        self._deferred_aborts: list[str] = []
        self.policy_stats: dict[str, float] = {}  # the worker's latest latency-model / calibration errors

    def _auto_num_pages(self, dtype: torch.dtype, device: torch.device, slots: int | None = None) -> int:
        """One worker's pages (an expert-parallel rank's, where `slots` is its share of max_running; None: all of
        max_running): enough for `slots` requests of max_model_len tokens, within a KV memory budget: 2 GiB on CPU;
        on a GPU what its free memory leaves after the worker's weights and GDN state (and a drafter's) and a
        reserve for activations and CUDA graphs (plan_kv_pages)."""
        cfg = self.config
        slots = cfg.max_running if slots is None else slots
        wanted = slots * -(-self.max_model_len // cfg.page_size)
        if device.type != "cuda":
            page_bytes = max(ModelCache.kv_bytes_per_token(self.model_config, dtype) * cfg.page_size, 1)
            return max(1, min(wanted, (2 << 30) // page_bytes))
        target = model_footprint(self.model_config, dtype, cfg.expert_parallel)
        drafter, drafter_slots = None, 0
        try:
            if cfg.spec == "mtp":
                drafter, drafter_slots = mtp_footprint(self.model_config, self.model_dir, dtype), slots + 1
            elif cfg.spec in ("draft", "replay") and cfg.draft_model is not None:
                drafter = model_footprint(ModelConfig.from_dir(cfg.draft_model), dtype)
                drafter_slots = 2 * slots + 1  # (DraftModelDrafter: a slot per request and its rollback)
        except (OSError, ValueError):
            pass  # the worker names what is wrong with the drafter's checkpoint
        free, total = torch.cuda.mem_get_info(device)
        return plan_kv_pages(free, total, wanted, cfg.page_size, slots, self.max_model_len, target,
                             drafter, drafter_slots, str(device),
                             share_of=cfg.max_running if slots != cfg.max_running else None)

    # ---- requests ---------------------------------------------------------------------------------------
    def validate_prompt(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequest("prompt must not be empty", "prompt")
        vocab = self.model_config.vocab_size
        for i, t in enumerate(prompt_ids):
            if not isinstance(t, numbers.Integral) or isinstance(t, bool) or not 0 <= t < vocab:
                raise InvalidRequest(
                    f"prompt_token_ids[{i}] must be an integer token id in [0, {vocab}), got {t!r}", "prompt_token_ids")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(
                f"prompt must be shorter than the model's length limit {self.max_model_len} tokens, "
                f"got {len(prompt_ids)}", "prompt")

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> Request:
        if request_id in self.live:
            raise InvalidRequest(f"request_id {request_id!r} is already in flight", "request_id")
        self.validate_prompt(prompt_ids)
        request = Request(request_id, [int(t) for t in prompt_ids], params)
        try:
            self.scheduler.add(request)
        except ValueError as e:
            raise InvalidRequest(str(e), "max_new_tokens") from e
        self.live[request_id] = _Live(request, IncrementalDetokenizer(self.tokenizer))
        return request

    def abort(self, request_id: str) -> None:
        if self._stepping:
            self._deferred_aborts.append(request_id)
            return
        live = self.live.pop(request_id, None)
        if live is not None and not live.request.finished:
            self.scheduler.finish(live.request, "abort")
            self.executor.release([request_id])

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def fail_running(self) -> list[str]:
        """Aborts every request whose state lives on the worker (e.g. after a restarted Ray actor lost its
        cache, or a step that raised); returns their ids. Waiting requests hold no worker state and stay queued.
        Where the aborts themselves fail, the core is in an unknown state: every live request's id is returned,
        so that no caller goes on stepping one of them."""
        ids = [r.request_id for r in self.scheduler.running]
        try:
            for rid in ids:
                self.abort(rid)
        except Exception:
            log.exception("failing the running requests failed")
            return list(self.live)
        return ids

    def stats(self) -> dict[str, int]:
        """Occupancy: free/used pages and slots, pool sizes, waiting and running requests."""
        s = self.memory.stats()
        s.update(total_pages=self.memory.pages.num_pages, total_slots=self.memory.slots.num_slots,
                 page_size=self.memory.pages.page_size, waiting_requests=len(self.scheduler.waiting),
                 running_requests=len(self.scheduler.running))
        return s

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- one step ---------------------------------------------------------------------------------------
    def step(self) -> list[StepOutput]:
        if self._stepping:
            raise RuntimeError("EngineCore.step called while a step runs (one engine, one step at a time)")
        self._stepping = True
        try:
            return self._step()
        finally:
            self._stepping = False
            deferred, self._deferred_aborts = self._deferred_aborts, []
            for rid in deferred:
                self.abort(rid)

    def _step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        if not plan.chunks:
            return []
        result = self.executor.execute(self.scheduler.step_requests(plan))
        if result.policy_stats:
            self.policy_stats = result.policy_stats
        self.scheduler.commit(plan, result.accepted_tokens, result.draft_cap_hint)
        for rid, n in result.draft_tokens.items():
            stats = self.live[rid].request.stats
            stats.draft_tokens += n
            stats.accepted_tokens += result.accepted_tokens.get(rid, 0)
            stats.verify_steps += 1
        outputs = [self._append(self.live[rid], toks) for rid, toks in result.new_tokens.items()]
        for out in outputs:
            out.draft_tokens = result.draft_tokens.get(out.request_id, 0)
            out.accepted_tokens = result.accepted_tokens.get(out.request_id, 0)
        finished = [o.request_id for o in outputs if o.finished]
        if finished:
            self.executor.release(finished)
        return outputs

    def _append(self, live: _Live, new_ids: list[int]) -> StepOutput:
        """Adds sampled tokens to a request, applies the stop conditions, returns what to stream."""
        request, params = live.request, live.request.params
        accepted: list[int] = []
        reason, stop_hit = None, False
        for tok in new_ids:
            request.output_ids.append(tok)
            accepted.append(tok)
            if tok in self.eos_ids and not params.ignore_eos:
                reason = "stop"
                break
            before = len(live.text)
            live.text += live.detok.push([tok])
            if params.stop:  # only a stop string that ends in the new text can be new: search the tail
                tail = max(0, before - max(map(len, params.stop)) + 1)
                if (cut := find_stop(live.text[tail:], params.stop)) is not None:
                    live.text, reason, stop_hit = live.text[:tail + cut], "stop", True
                    break
            if len(request.output_ids) >= params.max_new_tokens:
                reason = "length"
                break
        if reason is not None:
            if not stop_hit:
                live.text += live.detok.flush()
            self.scheduler.finish(request, reason)
            del self.live[request.request_id]
        holdback = stop_holdback(live.text, params.stop) if params.stop and reason is None else 0
        upto = len(live.text) - holdback
        new_text = live.text[live.emitted_chars:upto]
        live.emitted_chars = max(live.emitted_chars, upto)
        return StepOutput(request.request_id, accepted, new_text, reason is not None, reason,
                          request.stats if reason else None)
