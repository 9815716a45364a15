"""The benchmarks' random-weight model of a serving shape, its one-token-per-word tokenizer and their prompts (timing
only: the weights are noise), shared by bench_gpu.py, bench_compile_step.py and bench_exactness.py."""
from __future__ import annotations

import time

import torch

SHAPES = {  # LlamaConfig fields; vocab sizes are the real models'
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "smollm2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                    num_key_value_heads=3, vocab_size=49152, rope_theta=100000.0),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, rope_theta=10000.0),
}
CHUNK = 128
QUESTION_WORDS = 24


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def word_tokenizer(vocab_size: int):
    """One token per word "w<id>", every id of the model's vocabulary decodable."""
    from tokenizers import Tokenizer, models, pre_tokenizers, decoders
    from transformers import PreTrainedTokenizerFast

    vocab = {"<eos>": 0, "<unk>": 1} | {f"w{i}": i for i in range(2, vocab_size)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>", unk_token="<unk>")
    tokenizer.name_or_path = f"kvboost-bench-words-{vocab_size}"
    return tokenizer


def random_model(shape: str, device: str, dtype: torch.dtype, max_context: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(max_context, 8192), tie_word_embeddings=False,
                         bos_token_id=None, eos_token_id=0, pad_token_id=0)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            torch.manual_seed(0)
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(previous)
    with torch.no_grad():  # weights small enough that activations stay finite through every layer
        for parameter in model.parameters():
            if parameter.dim() > 1:
                parameter.normal_(0.0, 0.02)
    return model.eval()


def kv_bytes_per_token(model) -> int:
    """K and V of one token over every layer, in the model's dtype."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * model.dtype.itemsize


def words(count: int, seed: int, vocab_size: int) -> str:
    generator = torch.Generator().manual_seed(seed)
    return " ".join(f"w{i}" for i in torch.randint(2, vocab_size, (count,), generator=generator).tolist())


def colocated_daemon(stack, workdir, max_gb: int):
    """A cache daemon on a free loopback port over workdir/lmdb, read co-located (its map mapped), both closed with
    the ExitStack; returns the store."""
    from bench import harness
    from inference_service.store.colocated import ColocatedStore
    from inference_service.store.grpc_store import GrpcChunkStore, GrpcStoreOptions

    daemon = harness.start_daemon(stack, workdir, "--max-bytes", f"{max_gb}G", timeout_s=60)
    store = ColocatedStore(GrpcChunkStore(GrpcStoreOptions(address=daemon.address)), "on")
    stack.callback(store.close)
    store.check()
    return store


def tier_engines(model, tokenizer, configs: dict, store, stack, model_id: str, weights_id: str) -> dict:
    """An Engine per named EngineConfig over one store, each closed with the ExitStack. The "host" engine's failure
    to start (pinned memory refused, say) ends that path only, and says so."""
    from inference_service.engine.engine import Engine

    engines = {}
    for name, config in configs.items():
        try:
            engines[name] = Engine(model, tokenizer, config, store, model_id=model_id, weights_id=weights_id)
        except Exception as error:
            if name != "host":
                raise
            log(f"host tier: skipped, its engine failed to start: {type(error).__name__}: {error}")
            continue
        stack.callback(engines[name].close)
    return engines
