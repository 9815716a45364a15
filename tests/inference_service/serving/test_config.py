"""Inference service configuration: flags over KVBOOST_* environment over defaults, validation, secrets."""
from __future__ import annotations

import pytest

from inference_service.serving.config import ServiceConfig, parse_config


def test_defaults_are_the_documented_loopback_addresses_and_the_embedded_model() -> None:
    config = parse_config([], environ={})
    assert (config.listen, config.cache_addr, config.model) == ("127.0.0.1:50051", "127.0.0.1:50052", "SmolLM2-135M-Instruct")
    assert (config.engine.chunk_size, config.engine.kv_cache_bits, config.strict) == (128, 16, True)
    assert config.listens_on_loopback and not config.tls


def test_environment_sets_defaults_and_flags_win() -> None:
    environ = {"KVBOOST_MODEL": "/models/x", "KVBOOST_CHUNK_SIZE": "256", "KVBOOST_NO_STRICT": "1",
               "KVBOOST_CACHE_ADDR": "10.0.0.5:7000", "KVBOOST_DEVICE": "cpu"}
    config = parse_config(["--chunk-size", "64", "--listen", "0.0.0.0:9000"], environ=environ)
    assert (config.model, config.engine.chunk_size, config.strict) == ("/models/x", 64, False)
    assert (config.cache_addr, config.device, config.listen) == ("10.0.0.5:7000", "cpu", "0.0.0.0:9000")
    assert not config.listens_on_loopback


@pytest.mark.parametrize("argv, message", [
    (["--chunk-size", "0"], "--chunk-size must be positive"),
    (["--kv-cache-bits", "3"], "invalid choice"),
    (["--tls-cert", "cert.pem"], "--tls-cert and --tls-key go together"),
    (["--listen", "nohost"], "--listen must be HOST:PORT"),
    (["--max-queue", "0"], "--max-queue must be positive"),
    (["--device", "tpu"], "--device must be one of"),
])
def test_bad_flags_exit_with_a_usage_message(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert message in capsys.readouterr().err


def test_keys_before_rope_is_off_unless_a_flag_or_the_environment_turns_it_on() -> None:
    assert parse_config([], environ={}).engine.kv_keys_before_rope is False
    assert parse_config([], environ={"KVBOOST_KV_KEYS_BEFORE_ROPE": "1"}).engine.kv_keys_before_rope is True
    assert parse_config(["--kv-keys-before-rope"], environ={}).engine.kv_keys_before_rope is True
    flagged = parse_config(["--no-kv-keys-before-rope"], environ={"KVBOOST_KV_KEYS_BEFORE_ROPE": "1"})
    assert flagged.engine.kv_keys_before_rope is False


def test_a_bad_environment_value_names_the_variable() -> None:
    with pytest.raises(SystemExit, match="KVBOOST_MAX_QUEUE='many'"):
        parse_config([], environ={"KVBOOST_MAX_QUEUE": "many"})


def test_tokens_come_from_files_and_never_appear_in_the_description(tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret\n")
    config = ServiceConfig(auth_token_file=str(token_file))
    assert config.auth_token() == "s3cret"
    assert config.cache_auth_token() is None
    assert "s3cret" not in config.describe() and str(token_file) in config.describe()
    token_file.write_text("  \n")
    with pytest.raises(ValueError, match="is empty"):
        config.auth_token()


@pytest.mark.parametrize("listen, loopback", [
    ("127.0.0.1:1", True), ("127.0.0.2:1", True), ("[::1]:1", True), ("localhost:1", True),
    ("0.0.0.0:1", False), ("[::]:1", False), ("10.1.2.3:1", False), ("example.org:1", False),
])
def test_loopback_detection(listen, loopback) -> None:
    assert ServiceConfig(listen=listen).listens_on_loopback is loopback


def test_threads_and_decode_step_default_to_torchs_threads_and_the_exact_lean_step() -> None:
    config = parse_config([], environ={})
    assert (config.threads, config.engine.decode_step) == (0, "lean")
    config = parse_config(["--threads", "1"], environ={"KVBOOST_DECODE_STEP": "transformers", "KVBOOST_THREADS": "2"})
    assert (config.threads, config.engine.decode_step) == (1, "transformers")


@pytest.mark.parametrize("retired", ["split", "wide", "onednn"])
def test_a_retired_decode_step_runs_lean_with_a_warning(retired, caplog) -> None:
    with caplog.at_level("WARNING"):
        assert parse_config(["--decode-step", retired], environ={}).engine.decode_step == "lean"
        assert parse_config([], environ={"KVBOOST_DECODE_STEP": retired}).engine.decode_step == "lean"
    assert f"--decode-step {retired} was retired" in caplog.text


@pytest.mark.parametrize("argv, message", [
    (["--threads", "-1"], "--threads must be >= 0 (0: torch's default), got -1"),
    (["--decode-step", "compiled"], "invalid choice: 'compiled'"),
])
def test_bad_threads_or_decode_step_say_what_to_pass(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert message in capsys.readouterr().err


def test_set_threads_sets_torchs_intra_op_threads_and_zero_leaves_them() -> None:
    import torch

    from inference_service.model.loading import set_threads

    before = torch.get_num_threads()
    try:
        set_threads(0)
        assert torch.get_num_threads() == before
        other = 1 if before != 1 else 2
        set_threads(other)
        assert torch.get_num_threads() == other
    finally:
        torch.set_num_threads(before)


def test_the_fidelity_guard_is_unset_unless_a_flag_or_the_environment_sets_it() -> None:
    # Unset, the service takes the threshold tuned for the weights it loads (test_main.py, test_catalogue.py).
    assert parse_config([], environ={}).engine.guard_threshold is None
    assert parse_config([], environ={"KVBOOST_FIDELITY_GUARD": "0"}).engine.guard_threshold == 0.0
    assert parse_config(["--fidelity-guard", "2e-4"], environ={"KVBOOST_FIDELITY_GUARD": "0"}).engine.guard_threshold == 2e-4


def test_a_negative_fidelity_guard_says_what_to_pass(capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(["--fidelity-guard", "-1"], environ={})
    assert "--fidelity-guard must be a share >= 0 (0 = off)" in capsys.readouterr().err


def test_memory_flags_default_to_auto_and_a_number_wins() -> None:
    config = parse_config([], environ={})
    assert (config.engine.kv_cache_bytes, config.engine.l0_bytes) == (None, None)  # sized from the machine at start
    assert "kv_cache_bytes = auto" in config.describe() and "l0_bytes = auto" in config.describe()
    config = parse_config(["--l0-bytes", "0"], environ={"KVBOOST_KV_CACHE_BYTES": "1073741824"})
    assert (config.engine.kv_cache_bytes, config.engine.l0_bytes) == (1 << 30, 0)
    assert parse_config(["--kv-cache-bytes", "AUTO"], environ={"KVBOOST_KV_CACHE_BYTES": "5"}).engine.kv_cache_bytes is None


@pytest.mark.parametrize("argv, message", [
    (["--l0-bytes", "lots"], "'lots' is neither a number of bytes nor auto"),
    (["--kv-cache-bytes", "0"], "--kv-cache-bytes must be positive or auto"),
    (["--l0-bytes", "-1"], "--l0-bytes must be >= 0 (0 = off) or auto"),
])
def test_bad_memory_flags_say_what_is_accepted(argv, message, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ={})
    assert message in capsys.readouterr().err


def test_help_says_what_auto_means() -> None:
    from inference_service.serving.config import build_parser
    text = " ".join(build_parser({}).format_help().split())
    assert "`auto` (`inference_service/kv_memory/memory_plan.py`): on CUDA half of the device's free memory" in text
    assert "a quarter of the RAM available" in text


def test_recompute_when_faster_is_auto_unless_switched() -> None:
    assert parse_config([], environ={}).engine.recompute_when_faster is None  # auto: decided on the device at load
    assert parse_config([], environ={"KVBOOST_RECOMPUTE_WHEN_FASTER": "off"}).engine.recompute_when_faster is False
    assert parse_config(["--recompute-when-faster", "on"], environ={}).engine.recompute_when_faster is True
    assert "engine.recompute_when_faster = auto" in parse_config([], environ={}).describe()


def test_overlap_tokens_is_the_flag_and_the_old_overlap_k_still_works_with_a_warning(caplog, capsys) -> None:
    from inference_service.serving.config import build_parser
    assert parse_config([], environ={}).engine.overlap_tokens == 0
    assert parse_config(["--overlap-tokens", "4"], environ={"KVBOOST_OVERLAP_TOKENS": "2"}).engine.overlap_tokens == 4
    assert parse_config([], environ={"KVBOOST_OVERLAP_TOKENS": "2"}).engine.overlap_tokens == 2
    assert not caplog.text
    with caplog.at_level("WARNING"):
        assert parse_config(["--overlap-k", "3"], environ={}).engine.overlap_tokens == 3
        assert parse_config([], environ={"KVBOOST_OVERLAP_K": "5"}).engine.overlap_tokens == 5
        assert parse_config(["--overlap-tokens", "5"], environ={"KVBOOST_OVERLAP_K": "5"}).engine.overlap_tokens == 5
    assert caplog.text.count("--overlap-k (KVBOOST_OVERLAP_K) was renamed --overlap-tokens (KVBOOST_OVERLAP_TOKENS)") == 3
    with pytest.raises(SystemExit):  # two values under two names: which one was meant is not guessed
        parse_config(["--overlap-tokens", "4", "--overlap-k", "3"], environ={})
    assert "--overlap-k (KVBOOST_OVERLAP_K) is the old name of --overlap-tokens (KVBOOST_OVERLAP_TOKENS)" in \
        capsys.readouterr().err
    with pytest.raises(SystemExit):
        parse_config(["--overlap-k", "-1"], environ={})
    assert "--overlap-tokens must be >= 0, got -1" in capsys.readouterr().err
    assert "--overlap-k" not in build_parser({}).format_usage()


@pytest.mark.parametrize("argv, environ", [
    (["--max-batch-tokens", "4096"], {}),
    ([], {"KVBOOST_MAX_BATCH_TOKENS": "4096"}),
    (["--scheduler", "batch"], {}),
])
def test_a_removed_flag_or_its_variable_fails_saying_what_replaced_it(argv, environ, capsys) -> None:
    with pytest.raises(SystemExit):
        parse_config(argv, environ=environ)
    assert "was re" in capsys.readouterr().err  # "was replaced by --kv-cache-bytes" / "was removed"


def test_every_engine_flag_keeps_its_name_variable_and_default() -> None:
    # The names and defaults a deployment's command line and environment use, as they were before the fields
    # generated them: each variable still sets its flag's value.
    config = parse_config([], environ={})
    engine = config.engine
    assert (engine.chunk_size, engine.kv_cache_bits, engine.tenant_salt, engine.max_new_tokens_limit,
            engine.max_prompt_tokens, engine.default_mode, engine.default_recompute_strategy) == (
        128, 16, "", 4096, 0, "prefix_cache", "selective")
    assert (engine.recompute_ratio, engine.selective_tokens, engine.sink_tokens, engine.kv_group_size,
            engine.max_queue, engine.max_running_requests, engine.max_prefill_tokens,
            engine.max_answer_tokens_stored, engine.max_store_stream_bytes, engine.tokenizer_cache_bytes,
            engine.invariant_piece_chunks) == (0.15, 16, 0, 0, 64, 16, 0, 1024, 256 << 20, 64 << 20, 1)
    assert (engine.host_tier_bytes, engine.invariant_decode, engine.invariant_prefill) == (None, None, False)
    environ = {"KVBOOST_MAX_NEW_TOKENS": "9", "KVBOOST_RECOMPUTE_STRATEGY": "cacheblend",
               "KVBOOST_CACHE_MAX_STREAM_BYTES": "2097152", "KVBOOST_HOST_TIER_BYTES": "0",
               "KVBOOST_INVARIANT_PREFILL": "1", "KVBOOST_INVARIANT_DECODE": "on", "KVBOOST_TENANT_SALT": "acme"}
    engine = parse_config([], environ=environ).engine
    assert (engine.max_new_tokens_limit, engine.default_recompute_strategy, engine.max_store_stream_bytes,
            engine.host_tier_bytes, engine.invariant_decode, engine.tenant_salt) == (
        9, "cacheblend", 2 << 20, 0, True, "acme")
