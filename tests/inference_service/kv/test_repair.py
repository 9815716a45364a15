"""Tests for inference_service/repair.py: seams, token selection, and prefill of partly cached prompts."""
from __future__ import annotations

import pytest
import torch

from inference_service.kv.repair import (
    APPROX, EXACT, MISSING, STRATEGIES, RepairOptions, repair_prefill, seam_positions, select_tokens, selective_positions,
)
from inference_service.kv.rope import rerotate_keys, rope_parameters
from tests.factories import build_byte_tokenizer, tiny_config

E, A, M = EXACT, APPROX, MISSING


def make_model(kind: str = "llama", num_layers: int = 2):
    from transformers import AutoModelForCausalLM

    config = tiny_config(kind, vocab_size=len(build_byte_tokenizer()))
    config.num_hidden_layers = num_layers
    if kind == "qwen2":
        config.layer_types = ["full_attention"] * num_layers
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_sliding_window_mistral(window: int = 8):
    """A tiny Mistral whose every layer sees only the last `window` positions."""
    from transformers import AutoModelForCausalLM, MistralConfig

    llama = tiny_config("llama", vocab_size=len(build_byte_tokenizer())).to_dict()
    fields = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "max_position_embeddings")
    config = MistralConfig(**{name: llama[name] for name in fields}, sliding_window=window)
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def make_status(*runs: tuple[int, int]) -> torch.Tensor:
    """make_status((E, 2), (A, 3)) -> [E, E, A, A, A] as int8."""
    return torch.tensor([status for status, count in runs for _ in range(count)], dtype=torch.int8)


def full_prefill(model, input_ids: torch.Tensor):
    """(last-token logits [vocab], per-layer keys, per-layer values) of a plain forward."""
    with torch.no_grad():
        out = model(input_ids, use_cache=True)
    cache = out.past_key_values
    return out.logits[0, -1], [layer.keys for layer in cache.layers], [layer.values for layer in cache.layers]


def empty_kv(model, num_tokens: int):
    config = model.config
    shape = (1, config.num_key_value_heads, num_tokens, config.hidden_size // config.num_attention_heads)
    keys = [torch.zeros(shape) for _ in range(config.num_hidden_layers)]
    return keys, [torch.zeros(shape) for _ in range(config.num_hidden_layers)]


def reused_documents_prompt(model, num_prefix: int = 12, doc_lengths=(40, 40, 40), num_question: int = 10):
    """Random tokens as [prefix | doc1 | doc2 | doc3 | question]; see place_reused_documents."""
    generator = torch.Generator().manual_seed(3)
    lengths = [num_prefix, *doc_lengths, num_question]
    return place_reused_documents(model, [torch.randint(0, 256, (n,), generator=generator).tolist() for n in lengths])


def place_reused_documents(model, segments: list[list[int]]):
    """A prompt [prefix | documents... | question]: the prefix EXACT from its own prefill, each document
    APPROX from a run of the document alone at 0.., re-rotated into place, the question MISSING.

    Returns (input_ids [1, S], keys, values, status [S], seams [documents]).
    """
    prefix, documents, question = segments[0], segments[1:-1], segments[-1]
    input_ids = torch.tensor([sum(segments, [])])
    keys, values = empty_kv(model, input_ids.shape[1])
    params = rope_parameters(model.config)
    starts = torch.tensor([len(s) for s in segments]).cumsum(0)[:-1].tolist()
    for start, tokens in zip([0] + starts, [prefix] + documents):
        _, piece_keys, piece_values = full_prefill(model, torch.tensor([tokens]))
        stored, placed = torch.arange(len(tokens)), torch.arange(start, start + len(tokens))
        for layer, (k, v) in enumerate(zip(piece_keys, piece_values)):
            keys[layer][:, :, placed] = rerotate_keys(k, stored, placed, params)  # the prefix moves by 0
            values[layer][:, :, placed] = v
    num_documents = sum(len(d) for d in documents)
    status = make_status((E, len(prefix)), (A, num_documents), (M, len(question)))
    return input_ids, keys, values, status, torch.tensor(starts[: len(documents)])


def run_repair(model, input_ids, keys, values, status, **options):
    # repair_prefill updates keys/values in place: give each run its own copies.
    keys, values = [k.clone() for k in keys], [v.clone() for v in values]
    return repair_prefill(model, input_ids, keys, values, status, RepairOptions(**options))


# ---- pure position logic -------------------------------------------------------------------------------


def test_seam_positions_on_a_constructed_status():
    # positions: 0 1 | 2 3 4 | 5 | 6 7 8 9 | 10 11 | 12
    status = make_status((E, 2), (A, 3), (M, 1), (A, 4), (A, 2), (M, 1))
    # Runs of APPROX start at 2 and 6; 6..11 is one APPROX stretch, so a stored-run start at 10 comes
    # in through `seams`; a seam given on a MISSING token (5) is not an APPROX seam.
    assert seam_positions(status).tolist() == [2, 6]
    assert seam_positions(status, torch.tensor([10, 5])).tolist() == [2, 6, 10]


def test_selective_positions_take_the_first_tokens_after_each_seam():
    status = make_status((E, 2), (A, 3), (M, 1), (A, 4), (A, 2), (M, 1))
    # Two per seam: 2,3 after seam 2; 6,7 after seam 6; the run 6..11 is one window without seam 10.
    assert selective_positions(status, 2).tolist() == [2, 3, 6, 7]
    assert selective_positions(status, 2, torch.tensor([10])).tolist() == [2, 3, 6, 7, 10, 11]
    # A window stops at the end of its run: 4 tokens after seam 2 only reach 4.
    assert selective_positions(status, 4).tolist() == [2, 3, 4, 6, 7, 8, 9]
    assert selective_positions(status, 0).tolist() == []


def test_select_tokens_exact_indices():
    # positions:  0  1  2  3  4  5  6  7  8  9  10 11
    status = make_status((E, 2), (A, 4), (M, 1), (A, 4), (M, 1))
    deviation = torch.tensor([9.0, 9.0, 0.1, 5.0, 0.3, 2.0, 7.0, 4.0, 0.2, 5.0, 0.0, 8.0])
    # 8 APPROX tokens; ratio 0.25 -> the 2 largest: 3 (5.0) and 9 (5.0, tie goes to the earlier 3 first,
    # both fit); plus MISSING 6 and 11. EXACT 0 and 1 never, whatever their deviation.
    assert select_tokens(deviation, status, 0.25, sink_tokens=0).tolist() == [3, 6, 9, 11]
    # 3 of 8 -> 3, 9, then 7 (4.0).
    assert select_tokens(deviation, status, 0.375, sink_tokens=0).tolist() == [3, 6, 7, 9, 11]
    # A tie at the cut: 1 of 8 picks the earlier of 3 and 9.
    assert select_tokens(deviation, status, 0.125, sink_tokens=0).tolist() == [3, 6, 11]
    # Sinks: the first 3 positions, of which only 2 is not EXACT.
    assert select_tokens(deviation, status, 0.125, sink_tokens=3).tolist() == [2, 3, 6, 11]
    assert select_tokens(deviation, status, 0.0, sink_tokens=0).tolist() == [6, 11]
    assert select_tokens(deviation, status, 1.0, sink_tokens=0).tolist() == list(range(2, 12))


def test_options_are_validated():
    with pytest.raises(AssertionError, match="strategy"):
        RepairOptions(strategy="magic")
    with pytest.raises(AssertionError, match="recompute_ratio"):
        RepairOptions(recompute_ratio=1.5)
    with pytest.raises(AssertionError, match="check_layers"):
        RepairOptions(check_layers=0)


# ---- prefill with the model ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral-sliding-window"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_all_missing_equals_full_prefill(kind, strategy, tiny_llama, tiny_qwen2):
    models = {"llama": lambda: tiny_llama[0], "qwen2": lambda: tiny_qwen2[0], "mistral-sliding-window": make_sliding_window_mistral}
    model = models[kind]()
    input_ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(5))
    logits, full_keys, full_values = full_prefill(model, input_ids)
    result = run_repair(model, input_ids, *empty_kv(model, 37), make_status((M, 37)), strategy=strategy)
    torch.testing.assert_close(result.last_logits, logits, atol=1e-4, rtol=0)
    for layer, (k, v) in enumerate(zip(full_keys, full_values)):
        # A sliding-window model's own cache keeps only the last positions: compare those.
        kept = k.shape[2]
        torch.testing.assert_close(result.cache.layers[layer].keys[:, :, -kept:], k, atol=1e-5, rtol=0)
        torch.testing.assert_close(result.cache.layers[layer].values[:, :, -kept:], v, atol=1e-5, rtol=0)
    assert result.cache.get_seq_length() == 37
    assert result.num_recomputed == 0


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exact_prefix_plus_missing_tail_equals_full_prefill(kind, strategy, tiny_llama, tiny_qwen2):
    model = {"llama": tiny_llama, "qwen2": tiny_qwen2}[kind][0]
    input_ids = torch.randint(0, 256, (1, 37), generator=torch.Generator().manual_seed(6))
    logits, _, _ = full_prefill(model, input_ids)
    keys, values = empty_kv(model, 37)
    _, prefix_keys, prefix_values = full_prefill(model, input_ids[:, :30])
    for layer in range(len(keys)):
        keys[layer][:, :, :30], values[layer][:, :, :30] = prefix_keys[layer], prefix_values[layer]
    result = run_repair(model, input_ids, keys, values, make_status((E, 30), (M, 7)), strategy=strategy)
    torch.testing.assert_close(result.last_logits, logits, atol=1e-4, rtol=0)
    # The cache can be decoded from: one more token gives the same logits as a full forward.
    next_ids = torch.tensor([[65]])
    with torch.no_grad():
        step = model(next_ids, past_key_values=result.cache, use_cache=True).logits[0, -1]
        whole = model(torch.cat((input_ids, next_ids), dim=1)).logits[0, -1]
    torch.testing.assert_close(step, whole, atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_cacheblend_at_full_ratio_equals_full_prefill(kind):
    model = make_model(kind, num_layers=4)
    input_ids, keys, values, status, _ = reused_documents_prompt(model)
    logits, full_keys, _ = full_prefill(model, input_ids)
    result = run_repair(model, input_ids, keys, values, status, strategy="cacheblend", recompute_ratio=1.0)
    torch.testing.assert_close(result.last_logits, logits, atol=1e-4, rtol=0)
    torch.testing.assert_close(result.cache.layers[3].keys, full_keys[3], atol=1e-4, rtol=0)
    assert result.num_recomputed == 120


@pytest.mark.parametrize("check_layers", [1, 2])
def test_cacheblend_runs_later_layers_on_the_selected_tokens_only(check_layers):
    model = make_model("llama", num_layers=5)
    input_ids, keys, values, status, _ = reused_documents_prompt(model)  # 12 EXACT, 120 APPROX, 10 MISSING
    query_lengths: list[list[int]] = [[] for _ in model.model.layers]

    def record(index):
        def hook(module, args, kwargs):
            hidden = args[0] if args else kwargs["hidden_states"]
            query_lengths[index].append(hidden.shape[1])
        return hook

    handles = [layer.register_forward_pre_hook(record(i), with_kwargs=True) for i, layer in enumerate(model.model.layers)]
    try:
        result = run_repair(model, input_ids, keys, values, status, strategy="cacheblend",
                            recompute_ratio=0.15, check_layers=check_layers)
    finally:
        for handle in handles:
            handle.remove()
    # 15% of 120 APPROX = 18, plus the 10 MISSING question tokens; each layer is called exactly once.
    assert result.num_recomputed == 18
    expected = [[130]] * check_layers + [[28]] * (5 - check_layers)
    assert query_lengths == expected


def test_cacheblend_token_scores_choose_the_recomputed_tokens():
    model = make_model("llama", num_layers=3)
    input_ids, keys, values, status, _ = reused_documents_prompt(model)  # 12 EXACT, 120 APPROX, 10 MISSING
    scores = torch.zeros(status.numel())
    picked = [20, 57, 58, 99, 131]  # 5 of 120 APPROX ~ 4%: exactly these, whatever the measured deviation
    scores[picked] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    queried: list[torch.Tensor] = []
    hook = model.model.layers[2].register_forward_pre_hook(
        lambda m, a, k: queried.append(k["position_ids"][0].clone()), with_kwargs=True)
    try:
        result = run_repair_with(model, input_ids, keys, values, status, scores, recompute_ratio=5 / 120)
    finally:
        hook.remove()
    assert result.num_recomputed == 5
    assert queried[0].tolist() == picked + list(range(132, 142))  # the ranked tokens, then the MISSING question
    untouched = [p for p in range(12, 132) if p not in picked]
    torch.testing.assert_close(result.cache.layers[2].keys[:, :, untouched], keys[2][:, :, untouched], rtol=0, atol=0)


def run_repair_with(model, input_ids, keys, values, status, token_scores, **options):
    keys, values = [k.clone() for k in keys], [v.clone() for v in values]
    return repair_prefill(model, input_ids, keys, values, status, RepairOptions(strategy="cacheblend", **options),
                          token_scores=token_scores)


def test_selective_and_none_call_every_layer_on_their_tokens_only():
    model = make_model("llama", num_layers=3)
    input_ids, keys, values, status, seams = reused_documents_prompt(model)
    calls: list[int] = []
    handles = [layer.register_forward_pre_hook(lambda m, a, k: calls.append(a[0].shape[1]), with_kwargs=True)
               for layer in model.model.layers]
    try:
        none = run_repair(model, input_ids, keys, values, status, strategy="none")
        selective = run_repair(model, input_ids, keys, values, status, strategy="selective",
                               selective_tokens=4, sink_tokens=14)
        selective_seams = repair_prefill(model, input_ids, [k.clone() for k in keys], [v.clone() for v in values],
                                         status, RepairOptions(strategy="selective", selective_tokens=4), seams)
    finally:
        for handle in handles:
            handle.remove()
    # none: the 10 MISSING tokens. selective: 4 after the one APPROX run start (12), sinks 12 and 13 are
    # inside it, plus MISSING = 14; with the document starts as seams (12, 52, 92): 12 + 10 = 22.
    assert calls == [10] * 3 + [14] * 3 + [22] * 3
    assert (none.num_recomputed, selective.num_recomputed, selective_seams.num_recomputed) == (0, 4, 12)


def test_cacheblend_repairs_reused_documents_better_than_none():
    model = make_model("llama", num_layers=4)
    input_ids, keys, values, status, seams = reused_documents_prompt(model)
    logits, _, _ = full_prefill(model, input_ids)

    def error(**options) -> float:
        return (run_repair(model, input_ids, keys, values, status, **options).last_logits - logits).abs().max().item()

    error_none = error(strategy="none")
    error_blend = error(strategy="cacheblend", recompute_ratio=0.3)
    assert error_none > 1e-3, "reused documents must be approximate for the comparison to mean anything"
    assert error_blend < error_none


@pytest.mark.slow
def test_cacheblend_repairs_real_documents_on_smollm2(smollm2):
    model, tokenizer, _ = smollm2
    facts = ["falcon", "otter", "cobalt", "ember"]
    documents = [
        " ".join(f"Project {name}-{index} is run by team {facts[(index + j) % 4]} from room {index * 17 + j}."
                 for j in range(8)) + "\n"
        for index, name in enumerate(["Alder", "Birch", "Cedar", "Dogwood"])
    ]
    segments = [
        "<|im_start|>system\nAnswer from the documents.<|im_end|>\n<|im_start|>user\n",
        *documents,
        "Which team runs project Cedar-2?<|im_end|>\n<|im_start|>assistant\n",
    ]
    input_ids, keys, values, status, seams = place_reused_documents(model, [tokenizer(s)["input_ids"] for s in segments])
    logits, _, _ = full_prefill(model, input_ids)

    def kl_to_full(**options) -> float:
        repaired = run_repair(model, input_ids, keys, values, status, **options).last_logits
        return torch.nn.functional.kl_div(repaired.log_softmax(-1), logits.log_softmax(-1), log_target=True,
                                          reduction="sum").item()

    kl_none = kl_to_full(strategy="none")
    assert kl_none > 1e-3, "documents warmed alone must be approximate in the new context"
    assert kl_to_full(strategy="cacheblend", recompute_ratio=0.3) < kl_none
    assert kl_to_full(strategy="cacheblend", recompute_ratio=1.0) < 1e-6


# ---- the fidelity guard --------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_the_guard_measures_risk_and_falls_back_to_full_prefill(kind):
    model = make_model(kind, num_layers=4)
    input_ids, keys, values, status, _ = reused_documents_prompt(model)
    logits, full_keys, _ = full_prefill(model, input_ids)
    risks = [run_repair(model, input_ids, keys, values, status, strategy="cacheblend", recompute_ratio=ratio).risk
             for ratio in (0.05, 0.15, 0.5, 1.0)]
    assert risks[0] > 0 and risks == sorted(risks, reverse=True) and risks[-1] == 0.0  # more repaired, less left
    unguarded = run_repair(model, input_ids, keys, values, status, strategy="cacheblend", recompute_ratio=0.15)
    calm = run_repair(model, input_ids, keys, values, status, strategy="cacheblend", recompute_ratio=0.15,
                      guard_threshold=risks[1] * 2)
    assert not calm.guarded and calm.num_recomputed == unguarded.num_recomputed == 18
    torch.testing.assert_close(calm.last_logits, unguarded.last_logits, atol=0, rtol=0)
    fired = run_repair(model, input_ids, keys, values, status, strategy="cacheblend", recompute_ratio=0.15,
                       guard_threshold=risks[1] / 2)
    assert fired.guarded and fired.num_recomputed == 120 and fired.risk == pytest.approx(risks[1])
    torch.testing.assert_close(fired.last_logits, logits, atol=1e-4, rtol=0)  # full prefill's answer
    torch.testing.assert_close(fired.cache.layers[3].keys, full_keys[3], atol=1e-4, rtol=0)
    assert (unguarded.last_logits - logits).abs().max() > 1e-3  # the guard changed something


def test_the_guard_is_off_at_zero_and_only_measures_cacheblend():
    model = make_model("llama", num_layers=4)
    input_ids, keys, values, status, _ = reused_documents_prompt(model)
    assert not run_repair(model, input_ids, keys, values, status, strategy="cacheblend", guard_threshold=0.0).guarded
    selective = run_repair(model, input_ids, keys, values, status, strategy="selective", guard_threshold=1e-12)
    assert (selective.risk, selective.guarded) == (0.0, False)
    with pytest.raises(AssertionError, match="guard_threshold"):
        RepairOptions(guard_threshold=-0.1)
