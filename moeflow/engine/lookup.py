"""Prompt lookup decoding (transformers' ``prompt_lookup_num_tokens``): greedy generation that drafts tokens by
matching the last n-gram earlier in the sequence and verifies the whole draft in one forward pass.

Why it suits offloading: a pass over 1 + c tokens moves and computes each needed expert once for all of them, so
every accepted draft token saves a whole decode step's expert traffic (on repetitive text: code edits, quoting,
summaries). The output is greedy decoding's: a draft token is kept only where it equals the model's argmax at its
position, and the first position that disagrees contributes the model's own token. Drafts never change which
keys a later query attends to: a rejected draft's keys sit beyond the accepted length and are overwritten before
any query position reaches them (the static cache's mask is causal by position). Equal tokens need each position's
logits in a multi-token pass to equal a one-token pass's: so on the CPU path in every test; on a GPU in 16-bit, the
multi-token kernels may round differently from the decode ones, so a near-tie can resolve the other way (as in
transformers). Offload policies never change the tokens: with lookup as without, they compute what resident does.

Cost: a pass over 1 + c tokens needs the union of their experts, so on an MoE a rejected draft is not free; it
pays where replies quote their prompt (code edits, extraction). ``benchmarks/bench_prompt_lookup.py`` measures it.

Compiled and captured decode steps (``cuda_graphs`` / ``compile``; :func:`verify_width`). A pass without a draft
is the plain decode step. A pass with a draft has one static shape: ``1 + prompt_lookup_num_tokens`` tokens, a
shorter draft followed by *fillers* (the last token again) whose logits are never read; their keys land beyond
the accepted length (clamped into the cache), so the rejected-draft argument above covers them too. The runner
then replays a second captured step (same cache: both kept, each captured once) for every drafted pass instead of
running it eagerly. Fillers reach no expert where the expert backend runs outside the captured code (the offload
scheduler between graph pieces, or behind its graph break under torch.compile): they are masked out of the pass's
real tokens (``StepInfo.real_tokens``), so they move, count and predict nothing. The offload backend's captured
device part is bucketed by real-token count, so it holds up to 1 + N buckets (``DeviceGraphs.max_buckets``, 16:
larger counts run that part eagerly, logged). A backend the capture traces through (every expert resident: one
whole graph, which would bake in which tokens it computes) computes the fillers as real tokens; they move nothing.
Under ``compile=True`` alone the drafted width is one more shape for dynamo: one more whole graph (resident), or
the layer frames compiled again for the wide pass and its masked backend call, with symbolic sizes, whatever the
drafts' lengths (offloaded: 25 graphs against plain decode's 12 on the embedded model), then no recompile. With
an eager decode step every pass runs eagerly at its own width (no filler).

Limits (refused by the caller): batch size 1 and greedy decoding (as transformers' assisted generation), no
micro-batches, and no linear-attention states (Qwen3-Next's recurrent state would have to be rolled back).
"""

from __future__ import annotations

import time

import torch

from moeflow.engine.compiled import traces_through
from moeflow.engine.generate import Runner, positions_from_mask
from moeflow.engine.linear_state import HybridKVCache
from moeflow.engine.sampling import GenerationConfig, next_tokens
from moeflow.offload.stats import Stats
from moeflow.streaming import Streamer

DEFAULT_MAX_NGRAM = 2  # transformers' ``max_matching_ngram_size`` default


def find_draft(seq: torch.Tensor, num_tokens: int, max_ngram: int = DEFAULT_MAX_NGRAM) -> list[int]:
    """seq int64 [n] (host) -> up to ``num_tokens`` ids that followed the earliest earlier occurrence of the
    sequence's last n-gram, trying n = max_ngram down to 1 (transformers' PromptLookupCandidateGenerator)."""
    n = seq.numel()
    for size in range(min(max_ngram, n - 1), 0, -1):
        windows = seq.unfold(0, size, 1)  # [n - size + 1, size]
        hits = (windows == seq[n - size:]).all(dim=1).nonzero().flatten().tolist()
        for start in hits:
            begin = start + size
            end = min(begin + num_tokens, n)
            if begin < end:
                return seq[begin:end].tolist()
    return []


def check_lookup(gen: GenerationConfig, batch: int, num_tokens: object, max_ngram: object, micro_batch_size: object,
                 dual_batch: object) -> None:
    """Refuse, naming the argument, what prompt lookup decoding does not cover."""
    for name, value in (("prompt_lookup_num_tokens", num_tokens), ("max_matching_ngram_size", max_ngram)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{name} must be a positive integer, got {value!r}")
    if batch != 1:
        raise ValueError(f"prompt_lookup_num_tokens needs a batch of one sequence (got {batch}), as transformers' "
                         "assisted generation")
    if gen.do_sample:
        raise ValueError("prompt_lookup_num_tokens decodes greedily: pass do_sample=False")
    if micro_batch_size is not None or dual_batch:
        raise ValueError("prompt_lookup_num_tokens does not combine with micro_batch_size / dual_batch")


def begin_speculation(runner: Runner, gen: GenerationConfig, input_ids: torch.Tensor, token_mask: torch.Tensor,
                      option: str, streamer: Streamer | None = None, reuse: bool = True,
                      linear_ok: bool = False) -> tuple | None:
    """The set-up drafting decoders share (prompt lookup, MTP): the prompt to the streamer, the timings cleared,
    then None when no token is asked for, else ``(t, total, eos, cache, seq, pad, hist, hist_mask)``: the prompt
    length, the cache length, the eos ids, a one-row cache (``reuse``: the runner's kept one), the host copy of
    every token so far ``seq`` int64 [total] (left padding ``seq[:pad]`` never matched nor penalised), and every
    kept token on the device, cache-aligned (what path predictors read) ``hist`` / ``hist_mask`` [1, total].
    ``option`` names the caller's argument in the refusal of linear-attention models (``linear_ok``: the caller
    rolls their recurrent state back itself)."""
    t = input_ids.shape[1]
    if streamer is not None:
        streamer.put(input_ids.cpu())
    runner.stats.ttft_s = runner.stats.tpot_s = None
    if gen.max_new_tokens == 0:
        return None
    total = t + gen.max_new_tokens
    cache = runner.new_cache(1, total) if reuse else runner.new_cache(1, total, reuse=False)
    if isinstance(cache, HybridKVCache) and not linear_ok:
        raise ValueError(f"{option}: this model has linear-attention layers, whose recurrent state a rejected draft "
                         "would advance; use plain decoding")
    seq = torch.zeros(total, dtype=torch.long)
    seq[:t] = input_ids[0].cpu()
    pad = t - int(token_mask.sum())  # left padding: positions count real tokens only
    hist = torch.zeros((1, total), dtype=torch.long, device=runner.device)
    hist_mask = torch.ones((1, total), dtype=torch.bool, device=runner.device)
    hist[:, :t], hist_mask[:, :t] = input_ids, token_mask
    return t, total, set(gen.eos_ids()), cache, seq, pad, hist, hist_mask


def generate_with_lookup(runner: Runner, gen: GenerationConfig, input_ids: torch.Tensor, token_mask: torch.Tensor,
                         num_tokens: int, max_ngram: int = DEFAULT_MAX_NGRAM, streamer: Streamer | None = None
                         ) -> torch.Tensor:
    """input_ids / token_mask [1, T] on the device -> [1, T + n] ids, greedy, drafting up to ``num_tokens``
    tokens per pass. ``runner.stats`` counts ``draft_tokens`` / ``accepted_tokens`` (as its other counters, until
    ``reset()``); every pass goes through the runner's decode step (compiled or captured where the runner has
    one: a drafted pass at :func:`verify_width`)."""
    stats, device = runner.stats, runner.device
    start_state = begin_speculation(runner, gen, input_ids, token_mask, "prompt_lookup_num_tokens", streamer)
    if start_state is None:
        return input_ids
    t, total, eos, cache, seq, pad, hist, hist_mask = start_state
    width = verify_width(runner, num_tokens)
    fillers_real = traces_through(runner.backend)  # (a whole captured graph bakes in the tokens it computes)
    start = time.perf_counter()
    stats.set_phase("prefill")
    logits = runner.forward_pass(input_ids, positions_from_mask(token_mask), cache,
                                 torch.arange(t, device=device), token_mask, "prefill",
                                 history=(input_ids, token_mask), last_only=True)[:, -1]
    count_pass(stats, int(token_mask.sum()), start)
    first = pick(logits, gen, seq[pad:t], device)
    stats.ttft_s = time.perf_counter() - start
    new = [first]
    n = t
    decode_start = time.perf_counter()
    stats.set_phase("decode")
    while True:
        room = total - n - len(new)  # tokens still allowed after the ones just produced
        seq[n:n + len(new)] = torch.tensor(new)
        hist[0, n:n + len(new)] = seq[n:n + len(new)].to(device)
        n += len(new)
        if streamer is not None:
            streamer.put(torch.tensor([new]))  # [1, k]: one row, as transformers' streamers take it
        if room == 0 or eos.intersection(new):
            break
        start = time.perf_counter()
        draft = find_draft(seq[pad:n], min(num_tokens, room - 1), max_ngram) if room > 1 else []
        seq[n:n + len(draft)] = torch.tensor(draft, dtype=torch.long)  # (the penalty's history of each position)
        w = width if draft and width is not None else 1 + len(draft)
        ids, positions, cache_position, mask = pass_inputs(seq[n - 1:n + len(draft)], n - 1, w, pad, cache.max_len,
                                                           fillers_real, device)
        history = (hist[:, :n], hist_mask[:, :n])
        logits = runner.forward_pass(ids, positions, cache, cache_position, mask, "decode", history=history,
                                     all_real=fillers_real or w == 1 + len(draft))[0]  # [w, V]: rows > c unread
        new = []
        for j in range(len(draft) + 1):
            tok = pick(logits[j:j + 1], gen, seq[pad:n + j], device)
            new.append(tok)
            if j == len(draft) or tok != draft[j] or tok in eos:
                break
        stats.draft_tokens += len(draft)
        stats.accepted_tokens += len(new) - 1
        count_pass(stats, 1 + len(draft), start)
    produced = n - t
    if produced > 1:
        stats.tpot_s = (time.perf_counter() - decode_start) / (produced - 1)
    if device.type == "cuda":
        stats.peak_gpu_bytes = max(stats.peak_gpu_bytes, torch.cuda.max_memory_allocated(device))
    if streamer is not None:
        streamer.end()
    return hist[:, :n]


def verify_width(runner: Runner, num_tokens: int) -> int | None:
    """The one width of a drafted pass when the decode step is compiled or captured (``runner.decode_fn`` is not
    the eager decoder): 1 + ``num_tokens`` whatever the call's length (one shape per prompt_lookup_num_tokens, so
    one captured verify step per cache); None with an eager decode step (each pass its own width)."""
    return None if runner.decode_fn is runner.decoder else 1 + num_tokens


def pass_inputs(tokens: torch.Tensor, start: int, width: int, pad: int, max_len: int, fillers_real: bool,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """tokens int64 [r] (host: the last kept token, then the draft) at cache positions ``start`` on -> ids
    [1, width], position ids [1, width] (``pad``: left padding, which positions do not count), cache_position
    [width] and token_mask bool [1, width] on ``device``, in one copy. Positions from r on are fillers: the last
    token again, at the next cache positions clamped to ``max_len - 1`` (never a real position of a pass: a
    pass's last real token sits at most at total - 2); real tokens for the backend only if ``fillers_real``."""
    r = tokens.numel()
    host = torch.empty((4, width), dtype=torch.long)
    host[0, :r], host[0, r:] = tokens, tokens[-1]
    host[1] = torch.arange(start, start + width).clamp_(max=max_len - 1)
    host[2] = host[1] - pad
    host[3] = 1
    if not fillers_real:
        host[3, r:] = 0
    dev = host.to(device)
    return dev[0:1], dev[2:3], dev[1], dev[3:4].bool()


def pick(logits: torch.Tensor, gen: GenerationConfig, seen: torch.Tensor, device: torch.device) -> int:
    """logits [1, V] -> the greedy token, after the repetition penalty over ``seen`` int64 [N] (host) if any."""
    prior = seen.to(device)[None] if gen.repetition_penalty != 1.0 else None
    return int(next_tokens(logits, gen, None, prior)[0])


def count_pass(stats: Stats, tokens: int, start: float) -> None:
    """One forward pass of ``tokens`` tokens in the current phase."""
    phase = stats.current()
    phase.steps += 1
    phase.tokens += tokens
    phase.time_s += time.perf_counter() - start
