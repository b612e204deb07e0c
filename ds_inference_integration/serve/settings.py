"""`ds-inference serve`'s flags: the server's own (`ServeArguments`) beside the flag family's
(`DeepSpeedInferenceArguments`: --tp_size, --inference_dtype, --loading, --injection_policy, --inference_timeout
...), checked, with the model directory, before any rank starts: one `error:` line for a bad value."""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass, field
from pathlib import Path

from ..arguments import DeepSpeedInferenceArguments
from ..errors import InferenceSetupError

# A model whose config names no positions (T5: relative attention) has no length limit of its own, so a 500 KB prompt
# asked each rank for 80 GB and ended the server. vLLM assumes 2048 for such a model; so do we, unless its tokenizer
# says (model_max_length, as T5's own tokenizers do: 512).
DEFAULT_MAX_MODEL_LEN = 2048
# 4 MiB: a prompt filling a 128k-token context is about 0.5 MB of text or 0.8 MB of token ids; decoding a body this
# size never holds the front's event loop for more than a few ms (serve/bodies.py), but costs a worker thread up to
# 2.5 s of CPU for one of tiny numbers.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024
# The step engine's admission rule (TGI's waiting_served_ratio and max_waiting_tokens, whose defaults are 1.2 and
# 20). Default: every waiting row joins at the next step. Measured (`ds-inference bench serve --models gpt2
# --concurrency 16 --modes continuous,batched --requests 64 --repeats 1 [--output_lengths 4-48]`, 2026-12-05, output
# tok/s continuous / batched, fixed and mixed lengths): 0 and 0: 1.11x and 1.19x, p99 TTFT 0.21x and 0.13x; 0.3 and
# 4: 0.98x and 1.25x, 0.22x and 0.22x; 1.2 and 20: 1.00x and 1.15x, 0.22x and 0.57x. No setting gained beyond the
# repeats' spread here, and waiting costs time to first token; the flags stay for loads where prefills are dear.
# Measured again on #42's workload (max_tokens 8-128, concurrency 16, 3 repeats, the four servers side by side, a
# scratch script over bench serve's `_point`, 2026-12-05, commit f464bd5), tok/s against the batch engine's and p99
# TTFT: T5 tp 1: 0/0 1.28x (38-80 ms), 0.3/4 1.43x (36-89), 0.5/8 1.43x (51-61); T5 tp 2: 1.35x (85-114), 1.41x
# (133-164), 1.45x (227-260); gpt2-256 tp 1: 1.28x (47-52), 1.26x (60-66), 1.35x (80-123); the batch engine's p99
# TTFT 395-2280 ms. Grouping admissions gains up to ~0.15x where an admission is dear (T5: an encoder forward), at
# 2-3x the time to first token; a default other than 0/0 is #42's open question (one run, within run-to-run spread
# for GPT-2). A third time, in one run per tp (`ds-inference bench serve --models gpt2-256,t5 --concurrency 16
# --modes continuous,continuous_grouped,batched --requests 64 --repeats 3 --output_lengths 8-128 [--beam_fraction
# 0.25 | --output_lengths 64] --tp_size {1,2}`, continuous_grouped at 0.5/8, 2026-12-05, tok/s against the batch
# engine, 0/0 then 0.5/8): mixed tp 1 GPT-2 1.21x/1.48x, T5 1.23x/1.18x; tp 2 1.50x/1.41x, 1.49x/1.63x; with beams
# tp 1 1.51x/1.55x, 1.67x/1.64x, tp 2 2.90x/2.81x, 2.58x/2.26x; fixed 64 tp 1 0.99x/0.96x, 0.78x/0.86x, tp 2
# 1.02x/1.06x, 0.95x/0.94x; p99 TTFT 1.1-2.2x at 0.5/8. No rule wins beyond the spread: the default stays 0/0.
WAITING_SERVED_RATIO = 0.0
MAX_WAITING_STEPS = 0


@dataclass
class ServeArguments:
    host: str = field(default="127.0.0.1", metadata={"help": "Address to listen on (default: this machine only)."})
    port: int = field(default=8000, metadata={"help": "Port to listen on (0: any free port, printed at start)."})
    dp_size: int = field(default=1, metadata={"help": "Replicas, each a world of --tp_size ranks."})
    max_batch_size: int = field(default=32, metadata={"help": "Rows (sequences) per batch at most."})
    max_batch_tokens: int | None = field(
        default=None, metadata={"help": "Tokens per batch at most: rows x (longest prompt + most new tokens), padded; "
                                        "for the step engine, each running row's prompt + new tokens together."})
    max_wait_ms: float = field(default=20.0, metadata={"help": "A batch leaves at the latest when its oldest request "
                                                                 "has waited this long (the step engine's rows wait so "
                                                                 "only at an idle replica)."})
    adaptive_wait: bool = field(default=True, metadata={"help": "A batch also leaves once it holds as many requests "
                                                                "as the batch before it (false: only full, over the "
                                                                "token budget, or after --max_wait_ms)."})
    scheduler: str = field(default="continuous", metadata={
        "help": "How a replica runs rows: continuous (rows join and leave the running batch at every decoding step, "
                "beam requests as groups of slots; a model the step engine's probe refuses runs as batches, said at "
                "start) or batch (one generate a batch: a request waits for the running batch).",
        "choices": ["continuous", "batch"]})
    waiting_served_ratio: float = field(default=WAITING_SERVED_RATIO, metadata={
        "help": "The step engine: rows waiting join the running ones once they are this many times the running rows "
                "(a prefill holds the running rows back; prefilled together, rows cost about what one does), "
                "or after --max_waiting_steps, as TGI's router decides."})
    max_waiting_steps: int = field(default=MAX_WAITING_STEPS, metadata={
        "help": "The step engine: steps a waiting row waits at most for company before it joins the running rows."})
    max_queue: int = field(default=256, metadata={"help": "Requests waiting at most; more get 429 at once."})
    max_n: int = field(default=8, metadata={"help": "Largest n (outputs per prompt) a request may ask for."})
    max_tokens: int = field(default=16, metadata={"help": "max_tokens when a request gives none (OpenAI's default)."})
    max_model_len: int | None = field(
        default=None, metadata={"help": "Longest sequence a request may make: prompt + max_tokens (an encoder-decoder: "
                                        "the prompt, and max_tokens + 1). Default: the model's positions; for a model "
                                        f"without absolute positions (T5) {DEFAULT_MAX_MODEL_LEN}, or its tokenizer's "
                                        "model_max_length. The startup log says which."})
    max_body_bytes: int = field(default=DEFAULT_MAX_BODY_BYTES,
                                metadata={"help": "Largest request body; a larger one gets 413 before it is read."})
    served_model_name: str | None = field(default=None,
                                          metadata={"help": "The model id clients use (default: the directory name)."})
    api_key: str | None = field(default=None, metadata={"help": "Require `Authorization: Bearer KEY` on the API."})
    drain_timeout: float = field(default=60.0, metadata={"help": "SIGTERM: seconds to finish open requests."})
    log_dir: str | None = field(default=None, metadata={"help": "Where ranks other than 0 log (default: a temp dir)."})
    nnodes: int = field(default=1, metadata={"help": "Machines one replica spans (tensor parallelism across nodes); "
                                                     "the front runs on node 0, `--worker` on the others."})
    node_rank: int = field(default=0, metadata={"help": "This machine's index, 0 to --nnodes - 1."})
    master_addr: str = field(default="127.0.0.1", metadata={"help": "With --nnodes > 1: node 0's address, which every "
                                                                    "node's ranks reach."})
    master_port: int | None = field(default=None, metadata={"help": "With --nnodes > 1: the rendezvous port on node 0."})
    worker: bool = field(default=False, metadata={"help": "Run only this node's ranks of the replica (nodes 1.."
                                                          "--nnodes - 1); no HTTP front."})
    trust_remote_code: bool = field(default=False, metadata={
        "help": "Run the modeling code the model directory ships (its config.json's auto_map), in the front (config, "
                "tokenizer) and every rank; without it such a directory is refused at start."})


def announced_url(host: str, port: int) -> str:
    """How the front names where it listens in its first line, the port as bound (`--port 0`: one the kernel chose)."""
    return f"http://{f'[{host}]' if ':' in host else host}:{port}"


def announced_port(front_output: str) -> int | None:
    """The port in a front's first line (`announced_url`), None before it is printed: a starter that passes
    `--port 0` reads the port back here. A port chosen free by its starter and bound later by the server could be
    taken in between: a test's server once found its port in use (another process's connection had it), failing
    a CI run, 2026-12-06."""
    found = re.search(r" on http://(?:\[[^\]]*\]|[^\s:]+):(\d+),", front_output)
    return int(found.group(1)) if found else None


def parse(argv: list[str]) -> tuple[str, ServeArguments, DeepSpeedInferenceArguments]:
    """MODEL_DIR and the flags; every bad value one InferenceSetupError, before anything starts."""
    from transformers import HfArgumentParser

    from ..arguments import parse_args_into_dataclasses

    if not argv or argv[0].startswith("-"):
        raise InferenceSetupError("serve needs a model directory first; usage: ds-inference serve MODEL_DIR "
                                  "--tp_size T [--dp_size R] [--port 8000]")
    model_dir, rest = argv[0], argv[1:]
    parser = HfArgumentParser((ServeArguments, DeepSpeedInferenceArguments), prog="ds-inference serve MODEL_DIR")

    def one_line(message: str):  # argparse's own errors (a bad choice, an unknown flag): one line, not the usage
        raise InferenceSetupError(f"{message}; valid: see `ds-inference serve --help`")

    parser.error = one_line
    serve, inference = parse_args_into_dataclasses(parser, rest)
    inference.deepspeed_inference = True
    if not Path(model_dir, "config.json").is_file():
        raise InferenceSetupError(f"model directory {model_dir!r} has no config.json; valid: a directory "
                                  "save_pretrained wrote (or `ds-inference shard` wrote)")
    from ..load.own_code import check_trust

    check_trust(model_dir, serve.trust_remote_code)  # code to run and no --trust_remote_code: one line, at start
    for name, least in (("dp_size", 1), ("max_batch_size", 1), ("max_queue", 1), ("max_n", 1), ("max_tokens", 1),
                        ("max_body_bytes", 1024)):
        if getattr(serve, name) < least:
            raise InferenceSetupError(f"--{name} {getattr(serve, name)} is out of range; valid: {least} or more")
    if serve.max_model_len is not None and serve.max_model_len < 2:
        raise InferenceSetupError(f"--max_model_len {serve.max_model_len} is out of range; valid: 2 or more")
    if serve.max_batch_tokens is not None and serve.max_batch_tokens < 1:
        raise InferenceSetupError(f"--max_batch_tokens {serve.max_batch_tokens} is out of range; valid: 1 or more")
    if serve.waiting_served_ratio < 0 or serve.max_waiting_steps < 0:
        raise InferenceSetupError(f"--waiting_served_ratio {serve.waiting_served_ratio} --max_waiting_steps "
                                  f"{serve.max_waiting_steps} is out of range; valid: 0 or more each (0 and 0: every "
                                  "row joins at the next step)")
    if serve.max_wait_ms < 0:
        raise InferenceSetupError(f"--max_wait_ms {serve.max_wait_ms} is out of range; valid: 0 or more")
    if not 0 <= serve.port <= 65535:
        raise InferenceSetupError(f"--port {serve.port} is out of range; valid: 0 to 65535")
    if serve.host != "localhost":
        try:
            ipaddress.ip_address(serve.host)
        except ValueError:
            raise InferenceSetupError(f"--host {serve.host!r} is not an IP address; valid: 127.0.0.1 (default), "
                                      "0.0.0.0 (every interface), or one of this machine's addresses") from None
    if inference.tp_size is None:
        inference.tp_size = 1
    check_nodes(serve, inference.tp_size)
    return model_dir, serve, inference


def check_nodes(serve: ServeArguments, tp_size: int) -> None:
    if serve.nnodes < 1 or not 0 <= serve.node_rank < serve.nnodes:
        raise InferenceSetupError(f"--nnodes {serve.nnodes} --node_rank {serve.node_rank} is invalid; valid: --nnodes 1 "
                                  "or more, --node_rank 0 to --nnodes - 1")
    if serve.nnodes == 1:
        if serve.worker or serve.node_rank:
            raise InferenceSetupError("--worker (or a --node_rank) needs --nnodes 2 or more: a one-node replica has "
                                      "no worker nodes")
        return
    if tp_size % serve.nnodes:
        raise InferenceSetupError(f"--tp_size {tp_size} does not split over --nnodes {serve.nnodes}; valid: a tp size "
                                  "that is a multiple of the node count (the same number of ranks on every node)")
    if serve.dp_size != 1:
        raise InferenceSetupError(f"--dp_size {serve.dp_size} with --nnodes {serve.nnodes}: a replica that spans nodes "
                                  "is served alone; valid: --dp_size 1 (more replicas: more servers behind a balancer)")
    if serve.master_port is None:
        raise InferenceSetupError("--nnodes > 1 needs --master_port: the rendezvous port on node 0 that every node's "
                                  "ranks connect to")
    if (serve.node_rank == 0) == serve.worker:
        raise InferenceSetupError(f"--node_rank {serve.node_rank}{' --worker' if serve.worker else ''}: node 0 runs the "
                                  "front (no --worker), every other node --worker")


def engine_settings(model_dir: str, serve: ServeArguments, inference: DeepSpeedInferenceArguments) -> dict:
    """What every rank of a replica is started with (the engine's one argument, as JSON): the model, the flag
    family, and the rows a replica holds at most."""
    return {"model_dir": str(Path(model_dir).resolve()), "capacity": serve.max_batch_size, "scheduler": serve.scheduler,
            "admission": [serve.waiting_served_ratio, serve.max_waiting_steps], "trust": serve.trust_remote_code,
            "inference": {k: getattr(inference, k) for k in inference.__dataclass_fields__}}


def read_model_dir(model_dir: str, trust: bool = False):
    """The model directory's config, tokenizer and generation config, read once by the front before any rank starts
    (its own code run where `trust`: `--trust_remote_code`); a file that cannot be read (a malformed config.json
    printed 40 lines of tracebacks) or a tokenizer that is not there (transformers 5 builds an empty one: the server
    reported ready and answered every request "prompt 0 is empty") is one InferenceSetupError."""
    import json as json_

    from transformers import GenerationConfig

    from ..errors import first_line
    from ..load.own_code import load_config, load_tokenizer

    def refused(what: str, error: Exception) -> InferenceSetupError:
        why = first_line(error)
        if isinstance(error.__cause__ or error.__context__, json_.JSONDecodeError):
            why += f" ({first_line(error.__cause__ or error.__context__)})"
        return InferenceSetupError(f"model directory {model_dir!r}: {what} cannot be read: {why}; valid: the files "
                                   "save_pretrained writes")

    try:
        config = load_config(model_dir, trust)
    except InferenceSetupError:
        raise
    except Exception as e:  # noqa: BLE001 - any reason the config cannot be read is one line
        raise refused("config.json", e) from None
    try:
        tokenizer = load_tokenizer(model_dir, trust)
    except Exception as e:  # noqa: BLE001
        raise refused("the tokenizer", e) from None
    probe = tokenizer("a b c 1 2 3", add_special_tokens=False)["input_ids"]
    if not probe or len(tokenizer) <= len(set(tokenizer.all_special_ids)):
        raise InferenceSetupError(f"model directory {model_dir!r} has no tokenizer: AutoTokenizer made a "
                                  f"{type(tokenizer).__name__} of {len(tokenizer)} token(s), which tokenizes text to "
                                  f"{probe}; valid: a directory with its tokenizer's files (tokenizer.json, or the "
                                  "vocabulary files save_pretrained writes)")
    if Path(model_dir, "generation_config.json").is_file():
        try:
            generation_config = GenerationConfig.from_pretrained(model_dir)
        except Exception as e:  # noqa: BLE001
            raise refused("generation_config.json", e) from None
    else:
        generation_config = GenerationConfig.from_model_config(config)
    return config, tokenizer, generation_config


def model_limits(config, generation_config, serve: ServeArguments, tokenizer):
    """What a request may ask of this model (protocol.ModelLimits), and a line for the startup log naming where
    --max_model_len came from."""
    from ..predict.positions import decoder_positions, encoder_positions, sequence_positions
    from .protocol import ModelLimits

    encoder_decoder = bool(getattr(config, "is_encoder_decoder", False))
    source = encoder_positions(config) if encoder_decoder else None
    target = decoder_positions(config) if encoder_decoder else sequence_positions(config)
    own = max((p for p in (source, target) if p), default=None)
    length, why = serve.max_model_len, "--max_model_len"
    if length is not None and own is not None and length > own:
        raise InferenceSetupError(f"--max_model_len {length} is past the model's {own} positions; valid: 2 to {own}")
    if length is None:
        told = getattr(tokenizer, "model_max_length", None)
        if own is not None:
            length, why = own, "the model's positions"
        elif isinstance(told, int) and 1 < told < 10**7:
            length, why = told, "its tokenizer's model_max_length; the model has no absolute positions"
        else:
            length, why = DEFAULT_MAX_MODEL_LEN, "the model has no absolute positions; --max_model_len sets it"
    limits = ModelLimits(encoder_decoder=encoder_decoder, max_positions=min(length, target or length),
                         max_source_positions=min(length, source or length) if encoder_decoder else None,
                         max_n=serve.max_n, max_batch_size=serve.max_batch_size, default_max_tokens=serve.max_tokens,
                         model_greedy=not bool(getattr(generation_config, "do_sample", False)),
                         vocab_size=len(tokenizer), max_batch_tokens=serve.max_batch_tokens, max_model_len=length,
                         why="the model's positions" if why == "the model's positions" else "--max_model_len")
    return limits, f"max_model_len {length} ({why})"
