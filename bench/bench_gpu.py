"""TTFT of a warmed long prompt on a GPU by where its K/V come from, beside the machine's own limits; decode rates.

A random-weight model of a serving shape (bench/gpu_model.py: timing only). Per length, alternating: `BASELINE` (the
cache off), `plain prefill` (the model's own forward), `warmed` (the daemon's LMDB map read co-located, L0 off),
`from L0`, `from host tier` (CUDA only), each a new question after the warmed document; the engine's load rate. Then per
length and path where one request's time goes (bench/ttft_stages.py), one length's from-L0 request through the gRPC
stream beside in process (the hop), the machine's copy and memory limits, and decode: one stream and --clients rows
through the engine beside model.generate (--peer-cb: transformers' continuous batching) and the bandwidth bound.

    python bench/bench_gpu.py                              # Llama-3-8B shape, bf16, 256..32k, 3 runs (H200)
    python bench/bench_gpu.py --shape tiny --device cpu --lengths 300 --grpc-length 300 --runs 1   # no GPU: a smoke run
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import sys
import tempfile
import threading
import time
from contextlib import ExitStack
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import harness  # noqa: E402
from bench.gpu_model import (CHUNK, QUESTION_WORDS, SHAPES, colocated_daemon, kv_bytes_per_token, log,  # noqa: E402
                             random_model, word_tokenizer, words)
from bench.ttft_stages import format_row, median_row, split_request  # noqa: E402
from inference_service.engine.engine import Engine, EngineConfig, GenerationParams  # noqa: E402

# -- the machine's limits -------------------------------------------------------------------------------------------

def timed_copy(target: torch.Tensor, source: torch.Tensor, repeats: int = 3) -> float:
    """Median GB/s of target.copy_(source)."""
    rates = []
    for _ in range(repeats + 1):
        torch.cuda.synchronize()
        started = time.perf_counter()
        target.copy_(source, non_blocking=True)
        torch.cuda.synchronize()
        rates.append(source.numel() * source.element_size() / (time.perf_counter() - started) / 1e9)
    return harness.median(rates[1:])


def page_cache_to_pinned(path: Path, pinned: torch.Tensor, threads: int) -> float:
    """GB/s of copying a file already in the page cache (memory-mapped) into pinned memory with `threads` threads."""
    size = pinned.numel()
    with open(path, "rb") as file, mmap.mmap(file.fileno(), size, prot=mmap.PROT_READ) as mapped:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            source = torch.frombuffer(mapped, dtype=torch.uint8, count=size)
        bounds = [size * i // threads for i in range(threads + 1)]
        rates = []
        for _ in range(3):
            workers = [threading.Thread(target=lambda a, b: pinned[a:b].copy_(source[a:b]), args=(bounds[i], bounds[i + 1]))
                       for i in range(threads)]
            started = time.perf_counter()
            for worker in workers:
                worker.start()
            for worker in workers:
                worker.join()
            rates.append(size / (time.perf_counter() - started) / 1e9)
        source = None  # drop the tensor over the map before the map closes
    return harness.median(rates)


def machine_limits(workdir: Path, gib: int = 1) -> dict:
    size = gib << 30
    pinned = torch.empty(size, dtype=torch.uint8, pin_memory=True)
    pageable = torch.empty(size, dtype=torch.uint8)
    device = torch.empty(size, dtype=torch.uint8, device="cuda")
    limits = {"h2d_pinned_gbps": timed_copy(device, pinned), "h2d_pageable_gbps": timed_copy(device, pageable),
              "d2h_pinned_gbps": timed_copy(pinned, device)}
    other = torch.empty_like(device)
    limits["device_copy_gbps"] = 2 * timed_copy(other, device)  # bytes read and written
    path = workdir / "page-cache.bin"
    with open(path, "wb") as file:
        file.write(os.urandom(16 << 20) * (size // (16 << 20)))
    with open(path, "rb") as file:
        while file.read(64 << 20):  # in the page cache now
            pass
    for threads in (1, 4, 8):
        limits[f"page_cache_to_pinned_{threads}t_gbps"] = page_cache_to_pinned(path, pinned, threads)
    path.unlink()
    del pinned, pageable, device, other
    torch.cuda.empty_cache()
    return limits


# -- the runs -------------------------------------------------------------------------------------------------------

def plain_prefill_ms(model, tokenizer, prompt: str) -> float:
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=model.device)
    sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
    sync()
    started = time.perf_counter()
    with torch.inference_mode():
        logits = model(input_ids=ids, logits_to_keep=1).logits
        logits.argmax(-1).item()
    return (time.perf_counter() - started) * 1000


def ask(engine: Engine, prompt: str, mode: str | None = None) -> dict:
    before = engine.stats()
    outcome = engine.generate(GenerationParams(prompt=prompt, max_new_tokens=1, mode=mode))
    after = engine.stats()
    engine.flush_writes()  # the question's write-back never overlaps the next request
    assert not outcome.degraded, "the cache was unreachable during the benchmark"
    loaded = after.get("load_bytes", 0) - before.get("load_bytes", 0)
    seconds = after.get("load_seconds", 0.0) - before.get("load_seconds", 0.0)
    return {"ttft_ms": outcome.ttft_ms, "cached": outcome.cached_tokens, "prompt": outcome.prompt_tokens,
            "load_bytes": loaded, "load_gbps": loaded / seconds / 1e9 if seconds > 0 else 0.0}


def measure_length(length: int, args, model, tokenizer, engines: dict[str, Engine]) -> dict:
    vocab = model.config.vocab_size
    document = words(length - QUESTION_WORDS, seed=length, vocab_size=vocab)
    started = time.perf_counter()
    engines["warmed"].warm(document)
    engines["warmed"].flush_writes()
    warm_s = time.perf_counter() - started
    ask(engines["from L0"], document + " " + words(QUESTION_WORDS, seed=1, vocab_size=vocab))  # L0 takes the chunks
    tiers = [name for name in ("from L0", "from host tier") if name in engines]
    if "from host tier" in engines:  # fetched from the daemon once, then copied into the host tier's slabs
        ask(engines["from host tier"], document + " " + words(QUESTION_WORDS, seed=2, vocab_size=vocab))
    questions = iter(range(10, 1 << 30))  # a new question for every request
    prompt = lambda: document + " " + words(QUESTION_WORDS, seed=next(questions), vocab_size=vocab)  # noqa: E731
    samples = harness.alternate({
        "BASELINE": lambda: ask(engines["warmed"], prompt(), mode="baseline"),
        "plain prefill": lambda: {"ttft_ms": plain_prefill_ms(model, tokenizer, prompt()), "cached": 0, "prompt": 0,
                                  "load_bytes": 0, "load_gbps": 0.0},
        **{name: lambda name=name: ask(engines[name], prompt()) for name in ("warmed", *tiers)}}, args.runs)
    rows = {name: harness.summarize(runs) for name, runs in samples.items()}
    for row in rows.values():
        row["speedup_vs_baseline"] = rows["BASELINE"]["ttft_ms"] / row["ttft_ms"]
    rows["warm_s"] = warm_s
    return rows


def measure_stages(length: int, args, model, engines: dict[str, Engine]) -> dict:
    """Per path, where one request's time goes (ttft_stages.split_request), paths alternating run by run; medians."""
    vocab = model.config.vocab_size
    document = words(length - QUESTION_WORDS, seed=length, vocab_size=vocab)
    paths = {"BASELINE": (engines["warmed"], "baseline"), "warmed": (engines["warmed"], None),
             **{name: (engines[name], None) for name in ("from L0", "from host tier") if name in engines}}
    seeds = iter(range(10_000, 1 << 30))
    samples = harness.alternate({name: lambda engine=engine, mode=mode: split_request(
        engine, document + " " + words(QUESTION_WORDS, seed=next(seeds), vocab_size=vocab), mode)
        for name, (engine, mode) in paths.items()}, args.stage_runs)
    rows = {name: median_row(runs) for name, runs in samples.items()}
    log(f"  where the time goes, ms (medians of {args.stage_runs}; gpu: CUDA events):")
    for name, row in rows.items():
        log(format_row(name, row))
    return rows


def measure_grpc_hop(length: int, args, model, engine: Engine, store) -> dict:
    """The from-L0 request in process and through the service's gRPC stream (a streamed Generate, TTFT at the client
    to its first token event), alternating; medians and their difference (the hop)."""
    import grpc

    from inference_service.serving.config import ServiceConfig
    from kvboost.v1 import inference_pb2 as pb
    from kvboost.v1 import inference_pb2_grpc
    from tests.service_support import serving_in_thread

    vocab = model.config.vocab_size
    document = words(length - QUESTION_WORDS, seed=length, vocab_size=vocab)
    ask(engine, document + " " + words(QUESTION_WORDS, seed=3, vocab_size=vocab))  # its chunks in L0
    in_process, through_grpc = [], []
    with serving_in_thread(ServiceConfig(listen="127.0.0.1:0", cache_addr=""), engine) as port:
        with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
            stub = inference_pb2_grpc.InferenceServiceStub(channel)
            for run in range(max(3, args.runs)):
                questions = [words(QUESTION_WORDS, seed=20_000 + 10 * run + offset, vocab_size=vocab) for offset in (0, 1)]
                in_process.append(ask(engine, document + " " + questions[0])["ttft_ms"])
                started = time.perf_counter()
                for event in stub.Generate(pb.GenerateRequest(prompt=document + " " + questions[1], max_new_tokens=1),
                                           timeout=300):
                    if event.token_ids or event.HasField("result"):
                        through_grpc.append((time.perf_counter() - started) * 1000)
                        break
                engine.flush_writes()
    row = {"length": length, "in_process_ms": harness.median(in_process), "grpc_ms": harness.median(through_grpc)}
    row["hop_ms"] = row["grpc_ms"] - row["in_process_ms"]
    log(f"from L0 at {length} tokens: in process {row['in_process_ms']:.2f} ms, through gRPC {row['grpc_ms']:.2f} ms "
        f"(the hop {row['hop_ms']:.2f} ms; medians of {len(in_process)})")
    return row


def measure_decode(model, tokenizer, engine: Engine, tokens: int, clients: int, peer_cb: bool = False) -> dict:
    vocab = model.config.vocab_size
    prompt = words(200, seed=7, vocab_size=vocab)
    params = lambda seed: GenerationParams(prompt=words(200, seed=seed, vocab_size=vocab), max_new_tokens=tokens,
                                           ignore_eos=True, mode="baseline")
    engine.generate(params(1))  # warm-up
    one = engine.generate(params(2))
    started = time.perf_counter()
    outcomes = engine.generate_many([params(100 + i) for i in range(clients)])
    many_s = time.perf_counter() - started
    ids = torch.tensor([tokenizer(prompt)["input_ids"]], device=model.device)
    with torch.inference_mode():
        model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
        sync = torch.cuda.synchronize if model.device.type == "cuda" else (lambda: None)
        sync()
        started = time.perf_counter()
        model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
        sync()
    hf_tps = tokens / (time.perf_counter() - started)
    peer = {}
    if peer_cb:  # transformers' own continuous batching (paged attention) on the same prompts
        from transformers import GenerationConfig

        config = GenerationConfig(max_new_tokens=tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        inputs = [tokenizer(words(200, seed=100 + i, vocab_size=vocab))["input_ids"] for i in range(clients)]
        ours = model.config._attn_implementation  # the engine's registered attention: not one CB takes
        model.set_attn_implementation("sdpa")
        try:
            model.generate_batch(inputs=inputs[:2], generation_config=config)  # warm-up (and its graph capture)
            started = time.perf_counter()
            outputs = model.generate_batch(inputs=inputs, generation_config=config)
            peer = {"transformers_cb_output_tps": sum(len(o.generated_tokens) for o in outputs.values())
                    / (time.perf_counter() - started)}
        finally:
            model.set_attn_implementation(ours)
    return {**peer, "one_stream_tps": one.tokens_per_sec, "clients": clients, "step": engine.stats().get("decode_step"),
            "many_output_tps": sum(o.generated_tokens for o in outcomes) / many_s,
            # the rows' own decode rates while batched, summed: the steady-state rate (no prefill, no first token)
            "many_decode_tps": sum(o.tokens_per_sec for o in outcomes),
            "model_generate_tps": hf_tps}


def main(argv: list[str] | None = None) -> int | None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="8b", help="model shape (random weights)")
    parser.add_argument("--lengths", type=int, nargs="+", default=[256, 512, 2048, 8192, 32768], help="prompt tokens")
    parser.add_argument("--runs", type=int, default=3, help="alternating runs per length (medians)")
    parser.add_argument("--device", default="cuda", help="cuda, cuda:N, or cpu for a smoke run")
    parser.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    parser.add_argument("--l0-bytes", type=float, default=16.0, help="L0 of the 'from L0' engine, GiB (ignored with "
                        "--service-defaults)")
    parser.add_argument("--service-defaults", action="store_true", help="the 'from L0' engine as the service builds "
                        "it: --kv-cache-bytes and --l0-bytes auto, sized from the device's free memory after the other "
                        "engines (built first, with the numbers they need)")
    parser.add_argument("--decode-tokens", type=int, default=64, help="tokens per decode measurement (0: skip)")
    parser.add_argument("--clients", type=int, default=16, help="rows decoding at once in the batched measurement")
    parser.add_argument("--peer-cb", action="store_true", help="also time transformers' continuous batching "
                        "(model.generate_batch) on the batched decode's prompts")
    parser.add_argument("--compile", action="store_true", help="only bench_compile_step.py: torch.compile of the "
                        "layer loop under the CUDA graphs against the graphs alone, 1 and --clients rows over the "
                        "first --lengths columns")
    parser.add_argument("--stage-runs", type=int, default=3, help="requests per length and path split into stages "
                        "(tokenize, keys, Lookup, placement, the question's own prefill, the first sample; medians; "
                        "0: skip)")
    parser.add_argument("--grpc-length", type=int, default=2048, help="prompt tokens of the from-L0 request also "
                        "asked through the service's gRPC stream, alternating with in process (0: skip)")
    parser.add_argument("--invariant-prefill", action="store_true", help="every engine on the invariant path "
                        "(the service's --invariant-prefill, and on CUDA in half precision the invariant decode step): "
                        "its cost against a run without it")
    parser.add_argument("--invariant-piece-chunks", type=int, default=1, help="with --invariant-prefill: whole "
                        "chunks per prefill forward")
    parser.add_argument("--json", type=Path, help="write every figure here")
    args = parser.parse_args(argv)
    if args.compile:
        from bench import bench_compile_step

        return bench_compile_step.main(["--shape", args.shape, "--device", args.device, "--dtype", args.dtype,
                                        "--rows", "1", str(args.clients), "--context", str(args.lengths[0])]
                                       + (["--json", str(args.json)] if args.json else []))
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda needs a CUDA GPU; use --device cpu --shape tiny for a smoke run")
    results: dict = {"shape": args.shape, "dtype": args.dtype, "lengths": args.lengths, "runs": args.runs,
                     "invariant_prefill": args.invariant_prefill, "invariant_piece_chunks": args.invariant_piece_chunks,
                     "device": torch.cuda.get_device_name() if cuda else "cpu", "torch": torch.__version__}
    with ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvboost-bench-gpu-")))
        if cuda:
            log("measuring the machine's limits")
            results["limits"] = machine_limits(workdir)
            log(json.dumps({k: round(v, 1) for k, v in results["limits"].items()}))
        longest = max(args.lengths) + 2 * QUESTION_WORDS
        log(f"building a random-weight {args.shape}-shaped model on {args.device} in {args.dtype}")
        model = random_model(args.shape, args.device, getattr(torch, args.dtype), longest + 512)
        tokenizer = word_tokenizer(model.config.vocab_size)
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        results["weight_bytes"] = weight_bytes
        kv_per_token = kv_bytes_per_token(model)
        store_gb = max(4, int(kv_per_token * sum(args.lengths) * 2 / 1e9) + 2)
        store = colocated_daemon(stack, workdir, store_gb)
        slots_bytes = 2 * (longest + 320) * kv_per_token + (1 << 30)
        engines = {}

        def build(name: str, config: EngineConfig) -> None:
            engines[name] = Engine(model, tokenizer, config, store, model_id=f"random-{args.shape}",
                                   weights_id=f"kvboost-bench-random-{args.shape}-{args.dtype}-seed0")
            stack.callback(engines[name].close)

        invariant = dict(invariant_prefill=True, invariant_piece_chunks=args.invariant_piece_chunks) \
            if args.invariant_prefill else {}
        long_prompts = dict(chunk_size=CHUNK, max_prompt_tokens=longest, max_new_tokens_limit=max(64, args.decode_tokens),
                            max_running_requests=max(2, args.clients), **invariant)
        build("warmed", EngineConfig(l0_bytes=0, kv_cache_bytes=slots_bytes, **long_prompts))
        if args.decode_tokens:  # short prompts, a slot per client (the long-prompt engines hold two slots each)
            build("decode", EngineConfig(chunk_size=CHUNK, l0_bytes=0, max_prompt_tokens=1024, **invariant,
                                         max_new_tokens_limit=args.decode_tokens, max_running_requests=args.clients,
                                         kv_cache_bytes=(args.clients + 9) * (1024 + args.decode_tokens + 2) * kv_per_token))
        if cuda:  # the host tier is CUDA's only; sized to hold the longest prompt
            build("from host tier", EngineConfig(l0_bytes=0, host_tier_bytes=(longest + CHUNK) * kv_per_token,
                                                 kv_cache_bytes=slots_bytes, **long_prompts))
        else:
            log("from host tier: skipped (on a CPU there is no host tier: L0 already is host memory)")
        if args.service_defaults:  # last: auto sizes from what the device has free now
            build("from L0", EngineConfig(**long_prompts))
        else:
            build("from L0", EngineConfig(l0_bytes=int(args.l0_bytes * (1 << 30)), kv_cache_bytes=slots_bytes,
                                          **long_prompts))
        results["from_l0_config"] = {"kv_cache_bytes": engines["from L0"].config.kv_cache_bytes,
                                     "l0_bytes": engines["from L0"].config.l0_bytes}
        log(f"weights {weight_bytes / 1e9:.1f} GB, K/V {kv_per_token // 1024} KiB per token, "
            f"slots {engines['warmed'].core.layout}")
        results["by_length"] = {}
        for length in args.lengths:
            log(f"{length} tokens")
            rows = measure_length(length, args, model, tokenizer, engines)
            results["by_length"][length] = rows
            for name, row in rows.items():
                if name != "warm_s":
                    log(f"  {name:14s} TTFT {row['ttft_ms']:9.1f} ms  x{row['speedup_vs_baseline']:5.2f}  "
                        f"cached {row['cached']:6.0f}  load {row['load_bytes'] / 1e6:8.1f} MB at {row['load_gbps']:5.1f} GB/s")
            log(f"  warm (prefill and write-back of {length} tokens) {rows['warm_s']:.1f} s")
            if args.stage_runs:
                rows["stages"] = measure_stages(length, args, model, engines)
        if args.grpc_length:
            results["grpc"] = measure_grpc_hop(args.grpc_length, args, model, engines["from L0"], store)
        if args.decode_tokens:
            log("decode")
            decode = measure_decode(model, tokenizer, engines["decode"], args.decode_tokens, args.clients, args.peer_cb)
            if cuda:
                # a step reads every weight once; the copy's bytes read and written are what the memory moves
                decode["bound_tps"] = results["limits"]["device_copy_gbps"] * 1e9 / weight_bytes
            results["decode"] = decode
            log(json.dumps({k: round(v, 1) if isinstance(v, float) else v for k, v in decode.items()}))
        results["stats"] = {name: {k: v for k, v in engine.stats().items() if isinstance(v, (int, float))}
                            for name, engine in engines.items()}
    harness.write_json(args.json, results)


if __name__ == "__main__":
    main()
