"""`moeflow serve` (the OpenAI-compatible server), `moeflow chat` (an interactive prompt), `generate --chat`."""

from __future__ import annotations

import argparse
import os
import signal
import socket
import sys
from pathlib import Path

import torch

from moeflow.chat.reply_formats import REASONING_ALIASES, TOOL_FORMATS
from moeflow.cli.commands import (
    AUTO_ON_OFF,
    DTYPES,
    _add_generation_args,
    _default_device,
    _gb_or_auto,
    add_device_switches,
    add_loading_args,
    add_speculative_args,
    embedded_model_path,
    loading_from_args,
    offload_from_args,
    speculative_from_args,
)
from moeflow.streaming import first_sequence

API_KEY_ENV = "MOEFLOW_API_KEY"


def _load_model(args, cuda_graphs: bool | None):
    """The model of ``chat``, ``generate --chat`` and ``serve`` (``cuda_graphs``: from_pretrained's)."""
    from moeflow import MoEModel

    mtp = speculative_from_args(args) is not None
    offload = offload_from_args(args, args.slots, args.policy)
    dtype = DTYPES[args.dtype] if args.dtype else None
    return MoEModel.from_pretrained(args.model or str(embedded_model_path()), device=args.device,
                                    dtype=dtype, offload=offload, kernels=args.kernels,
                                    cuda_graphs=cuda_graphs, mtp=mtp, **loading_from_args(args))


class ReplyStreamer:
    """Streams a chat reply split by destination (``split(ids, final)``: a serve ``SplitAssembler``'s ``reply``;
    harmony for gpt-oss, ``<think>`` / tool-call markup for others) to ``stream``: the reasoning after
    "(thinking) ", then the answer on its own line; tool calls are printed whole when they end."""

    def __init__(self, split, stream=None) -> None:
        self.split, self.stream = split, stream or sys.stdout
        self.ids: list[int] = []
        self.printed = {"reasoning": "", "content": ""}
        self._prompt_seen = False

    def put(self, ids: torch.Tensor) -> None:
        if not self._prompt_seen:  # generate() hands the prompt first
            self._prompt_seen = True
            return
        self.ids.extend(int(i) for i in first_sequence(ids))
        self._emit(final=False)

    def _emit(self, final: bool) -> None:
        reply = self.split(self.ids, final)
        for field, label in (("reasoning", "(thinking) "), ("content", "")):
            text = getattr(reply, field) if final else getattr(reply, field).rstrip("\ufffd")
            done = self.printed[field]
            if len(text) > len(done) and text.startswith(done):
                if not done:
                    self.stream.write(("\n" if field == "content" and self.printed["reasoning"] else "") + label)
                self.stream.write(text[len(done):])
                self.printed[field] = text
        if final:
            for call in reply.tool_calls:
                self.stream.write(f"\n(tool call) {call.name}({call.arguments})")
        self.stream.flush()

    def end(self) -> None:
        self._emit(final=True)
        self.stream.write("\n")
        self.stream.flush()


def reply_assembler(tokenizer, stops: tuple[int, ...], prompt: str):
    """How the server would split this model's chat reply to ``prompt`` (a ``SplitAssembler``), or None: plain."""
    from moeflow.chat.template import ChatTemplate
    from moeflow.serve.text import ChatReplies, SplitAssembler

    template = ChatTemplate.from_directory(tokenizer.path.parent)
    text = "\n".join(template.templates.values()) if template is not None else None
    assembler = ChatReplies(tokenizer, text).assembler([], set(stops), prompt, None, None)
    return assembler if isinstance(assembler, SplitAssembler) else None


def _chat_reply(model, messages: list[dict], args) -> str:
    """Generate one assistant turn for ``messages``, streamed to stdout; returns its answer (the reasoning is shown
    but not kept: harmony and the thinking models' templates drop it from finished turns)."""
    from moeflow.chat.template import ChatTemplate, stop_token_ids
    from moeflow.streaming import TextStreamer

    tok = model.tokenizer
    prompt = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    ids = tok.encode(prompt, add_special_tokens=False)
    stops = stop_token_ids(ChatTemplate.from_directory(tok.path.parent), model.generation_config.eos_ids(), tok.encode)
    do_sample = True if args.sample else (False if args.greedy else None)
    split = reply_assembler(tok, tuple(stops), prompt)
    streamer = ReplyStreamer(split.reply) if split is not None else TextStreamer(tok)
    out = model.generate(torch.tensor([ids]), max_new_tokens=args.max_new_tokens, do_sample=do_sample,
                         temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, min_p=args.min_p,
                         repetition_penalty=args.repetition_penalty, prompt_lookup_num_tokens=args.prompt_lookup,
                         num_speculative_tokens=speculative_from_args(args), eos_token_id=list(stops),
                         streamer=streamer, seed=args.seed)
    reply = out[0, len(ids):].tolist()
    if split is not None:
        return split.reply(reply, final=True).content
    if reply and reply[-1] in stops:
        reply = reply[:-1]
    return tok.decode(reply)


def _check_tokenizer(model) -> bool:
    if model.tokenizer is None:
        print(f"error: {model.name_or_path} has no tokenizer.json, which chat needs", file=sys.stderr)
        return False
    return True


def cmd_generate_chat(args, plain) -> int:
    """``generate --chat``: the prompt as one user message of the checkpoint's chat template."""
    if not args.chat:
        return plain(args)
    model = _load_model(args, AUTO_ON_OFF[args.cuda_graphs])
    if not _check_tokenizer(model):
        return 2
    _chat_reply(model, [{"role": "user", "content": args.prompt}], args)
    print(model.stats.summary())
    return 0


def cmd_chat(args) -> int:
    """An interactive conversation; empty line or EOF ends it, ``/reset`` forgets the history."""
    model = _load_model(args, AUTO_ON_OFF[args.cuda_graphs])
    if not _check_tokenizer(model):
        return 2
    messages: list[dict] = [{"role": "system", "content": args.system}] if args.system else []
    print(f"moeflow chat: {model.name_or_path} ({model.device}); an empty line or Ctrl-D ends, /reset forgets")
    while True:
        try:
            line = input("you> ")
        except EOFError:
            print()
            return 0
        if not line.strip():
            return 0
        if line.strip() == "/reset":
            messages = messages[:1] if args.system else []
            continue
        messages.append({"role": "user", "content": line})
        sys.stdout.write("assistant> ")
        messages.append({"role": "assistant", "content": _chat_reply(model, messages, args)})


def listening_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to (host, port) and already listening. Listening before the address is printed lets a
    client that reads it connect into the backlog while uvicorn starts (seconds on a loaded machine) instead of
    being refused."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    return sock


def cmd_serve(args) -> int:
    import uvicorn

    from moeflow.engine.continuous import ContinuousEngine, key_bucket, padded_batch
    from moeflow.engine.kv_slots import SlotKVCache, row_bytes
    from moeflow.engine.memory import DEFAULT_CONTEXT as KV_BUDGET_TOKENS
    from moeflow.serve.app import create_app
    from moeflow.serve.metrics import ServeMetrics

    speculative = speculative_from_args(args)  # (before loading: the flags' own errors first)
    if speculative is not None and args.cuda_graphs == "on":
        raise ValueError("--speculative mtp runs the server's passes eagerly (the MTP layers read every pass's "
                         "hidden states): leave --cuda-graphs auto or off")
    if args.threads:
        torch.set_num_threads(args.threads)
    # SIGTERM ends the server at once, as before main's handler: uvicorn shuts down gracefully, then raises the
    # signal again; there is nothing on disk to clean up, and tearing the model down at exit takes seconds
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    # CUDA graphs (auto: on CUDA): the engine captures its decode passes per padded batch size and key bucket
    model = _load_model(args, AUTO_ON_OFF[args.cuda_graphs])
    # the first pass pays one-time costs (op registration, lazy imports: seconds on a CPU): not the first client
    # (a prefill only: generate keeps no decode graphs for the engine's first capture to drop)
    model.generate(torch.zeros((1, 1), dtype=torch.long), max_new_tokens=1, do_sample=False)
    cfg = model.config
    max_len = args.max_model_len or min(cfg.max_position_embeddings, KV_BUDGET_TOKENS)
    if args.kv_cache_gb is not None:
        budget = int(args.kv_cache_gb * 2**30)
    elif model.device.type == "cuda":  # what from_pretrained reserved for the KV cache when it sized the expert slots
        budget = row_bytes(model, max(KV_BUDGET_TOKENS, max_len))
    else:  # host memory: --max-batch rows
        budget = None
    if speculative is not None and budget is not None:  # the MTP drafter's per-row buffers share the budget
        from moeflow.engine.continuous_mtp import mtp_row_bytes

        per_row = row_bytes(model, max_len)
        budget = budget * per_row // (per_row + mtp_row_bytes(model, max_len))
    cache = SlotKVCache.for_model(model, max_len, budget, max_rows=args.max_batch)
    metrics = ServeMetrics(model.stats, cache)
    engine = ContinuousEngine(model, cache, max_queue=args.max_queue, prefill_chunk=args.prefill_chunk,
                              listener=metrics, prefix_cache=args.prefix_cache == "on",
                              prompt_lookup=args.prompt_lookup, max_matching_ngram_size=args.max_matching_ngram_size,
                              num_speculative_tokens=speculative, micro_batch_size=args.micro_batch_size,
                              token_scheduler=args.token_scheduler)
    # the decode steps of every padded batch size at the smallest key bucket, captured before the first client
    steps, seconds = engine.warm_up()
    if engine.graphs is not None:
        verify = f", prompt lookup's {1 + args.prompt_lookup}-token verify step" if engine.lookup is not None else ""
        print(f"moeflow serve: captured {steps} decode steps (batch sizes up to {padded_batch(cache.rows)}{verify}, "
              f"{key_bucket(1, max_len)} keys) in {seconds:.2f} s", flush=True)
    model.stats.reset()
    metrics.watch_graphs(engine.graphs)
    metrics.watch_prefix(engine.prefix)
    metrics.count_drafts_as("mtp" if engine.mtp is not None else "prompt_lookup")
    source = args.model or str(embedded_model_path())
    name = args.served_model_name or (Path(source).name if Path(source).exists() else source)
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    app = create_app(model, engine, metrics, name, api_key=api_key, aliases=(source,),
                     tool_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)

    sock = listening_socket(args.host, args.port)
    port = sock.getsockname()[1]
    print(f"moeflow serve: model '{name}' on http://{args.host}:{port}/v1 | {model.device}, policy "
          f"{model.offload.policy!r} | KV cache {cache.rows} rows x {max_len} tokens "
          f"({cache.nbytes / 2**20:.1f} MiB) | "
          f"CUDA graphs {'on' if engine.graphs is not None else 'off'} | prefix cache {args.prefix_cache} | "
          f"prompt lookup {args.prompt_lookup or 'off'} | "
          f"token scheduler {_describe(engine.regroup)} | "
          f"MTP speculation {f'{speculative} tokens, {engine.mtp.nbytes / 2**20:.1f} MiB' if speculative else 'off'} | "
          f"API key {'required' if api_key else 'off'}", flush=True)
    config = uvicorn.Config(app, log_level=args.log_level, timeout_graceful_shutdown=5)
    uvicorn.Server(config).run(sockets=[sock])
    return 0


def _describe(regroup) -> str:
    """The serve banner's token-scheduler field (``ContinuousEngine.regroup``)."""
    if regroup is None:
        return "off"
    size = "2 micro-batches" if regroup.micro_batch_size == "auto" else f"micro-batches of {regroup.micro_batch_size}"
    return f"{regroup.scheduler}, {size}"


def _micro_batch_size(text: str) -> int | str | None:
    """--micro-batch-size: "auto", "off" (None) or an integer >= 1."""
    if text in ("auto", "off"):
        return None if text == "off" else text
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected auto, off or an integer >= 1, got {text!r}")
    return value


def _add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, help="checkpoint directory, hub id or .gguf (default: the embedded model)")
    p.add_argument("--device", default=_default_device())
    p.add_argument("--dtype", choices=list(DTYPES), default=None)
    p.add_argument("--kernels", choices=["auto", "torch", "triton"], default="auto")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--slots", type=int, default=None, help="GPU expert slots")
    budget.add_argument("--gpu-memory-gb", type=_gb_or_auto, default=None,
                        help="device memory budget in GB, or 'auto'; sizes the expert slots")
    p.add_argument("--host-memory-gb", type=_gb_or_auto, default=None,
                   help="host memory budget in GB, or 'auto'; experts that do not fit are read from disk")
    p.add_argument("--background-load", action="store_true",
                   help="ready once the non-expert weights are loaded; experts fill host memory in the background "
                        "(read on demand until then; needs an offloading placement)")
    add_loading_args(p)
    p.add_argument("--policy", default=None,
                   help="an offload policy (default: every expert on the device when they fit, else 'auto'; "
                        "'auto' when --slots or --gpu-memory-gb is given)")


def register(sub) -> None:
    from moeflow.engine.continuous_regroup import SCHEDULERS

    p = sub.add_parser("serve", help="an OpenAI-compatible HTTP server (docs/serving.md)")
    _add_model_args(p)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0: any free port (printed at start)")
    p.add_argument("--max-batch", type=int, default=16, help="most sequences decoded together (KV rows)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context per sequence (default: the model's, at most 4096)")
    p.add_argument("--kv-cache-gb", type=float, default=None,
                   help="KV cache budget (default on CUDA: what expert sizing reserved, 4096 positions; "
                        "on the CPU: --max-batch rows)")
    p.add_argument("--max-queue", type=int, default=64, help="waiting requests before answering 503")
    p.add_argument("--prefill-chunk", type=int, default=64, help="prompt tokens read per scheduler iteration")
    p.add_argument("--prefix-cache", choices=["on", "off"], default="on",
                   help="a finished request's KV row is kept for the next prompt that starts the same way")
    p.add_argument("--prompt-lookup", type=int, default=0, metavar="N",
                   help="draft up to N tokens per decode pass from the request's own context while one greedy "
                        "request decodes alone (0: off; docs/serving.md)")
    p.add_argument("--max-matching-ngram-size", type=int, default=2,
                   help="longest n-gram --prompt-lookup matches (as generate's max_matching_ngram_size)")
    add_speculative_args(p)
    p.add_argument("--micro-batch-size", type=_micro_batch_size, default=None, metavar="auto|off|N",
                   help="decode steps as micro-batches of at most N rows grouped by predicted routing paths "
                        "(ExpertFlow's token scheduler; auto: two micro-batches under a policy that predicts routing "
                        "paths, expertflow; off, the default: one pass per step; docs/serving.md)")
    p.add_argument("--token-scheduler", choices=list(SCHEDULERS), default="policy",
                   help="how --micro-batch-size groups the rows: the policy's choice, the paper's clustering, "
                        "the clustering unless the contiguous split activates no more experts, or row order")
    p.add_argument("--api-key", default=None, help=f"require 'Authorization: Bearer KEY' (or set {API_KEY_ENV})")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: directory name)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])
    add_device_switches(p, "passes")
    p.add_argument("--tool-call-parser", choices=["auto", "none", *TOOL_FORMATS], default="auto",
                   help="the markup chat replies write tool calls in (auto: from the chat template)")
    p.add_argument("--reasoning-parser", choices=["auto", "none", *REASONING_ALIASES], default="auto",
                   help="split <think>...</think> into reasoning_content (auto: when the template or vocabulary "
                        "has <think>)")
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("chat", help="chat with a model in the terminal (its chat template, streamed)")
    p.add_argument("--model", default=None, help="checkpoint directory, hub id or .gguf (default: the embedded model)")
    _add_generation_args(p, None)
    p.add_argument("--system", default=None, help="a system message")
    p.set_defaults(func=cmd_chat)

    generate = sub.choices["generate"]
    generate.add_argument("--chat", action="store_true", help="send --prompt as a user message of the chat template")
    plain = generate.get_default("func")
    generate.set_defaults(func=lambda args: cmd_generate_chat(args, plain))
