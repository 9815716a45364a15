"""Where the router finds the replicas' tokenizer, and that it loads it without transformers, tokenizing as
AutoTokenizer does (the service's tokenizer) on prompts and chats."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvboost_common import catalogue
from router.startup import tokenize_probes
from router.tokenizer import FileTokenizer, TokenizerNotFound, load_tokenizer, tokenizer_source
from tests.factories import build_byte_tokenizer

TEXTS = ["Replica check: <|im_start|>12,345 naïve cafés\n\n  indented\tline — done.", "", "x",
         "<|endoftext|>a<|im_end|><|im_end|>b", "日本語のテキスト 🙂 and <pad> inside", " leading and trailing  "]
CHATS = [
    [("user", "Hello there!")],
    [("system", "You are terse — très <b>\"bold\"</b>."), ("user", "Sum 12,345 + 6?"), ("assistant", "12,351"), ("user", "and <|im_end|>?")],
    [("assistant", "I speak first."), ("user", "  spaces \t and\n\nnewlines  ")],
    [("system", "A long document: " + "lorem ipsum dolor sit amet " * 40), ("user", "naïve — cafés \"quoted\" <b>")],
]
# Uses what transformers gives a template beyond the messages: bos_token, a named token only the config declares,
# tojson, namespace, loop controls, the generation block, raise_exception on a branch the chats never take.
RICH_TEMPLATE = (
    "{{ bos_token }}{% set state = namespace(turns=0) %}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role') }}{% endif %}"
    "{% set state.turns = state.turns + 1 %}"
    "{% if message['role'] == 'system' and loop.first %}<|im_start|>system {{ message['content'] | tojson }}<|im_end|>\n"
    "{% continue %}{% endif %}"
    "<|im_start|>{{ message['role'] }}\n"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] }}{% endgeneration %}"
    "{% else %}{{ message['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {{ image_token }} {{ state.turns }}\n{% endif %}"
)


def save_rich_tokenizer(folder) -> None:
    """A byte-level tokenizer whose post-processor adds BOS, with a chat template that uses the environment, and a
    config that declares a special token tokenizer.json lacks."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    # A copy of its own: build_byte_tokenizer() is one object cached for the whole session, which other tests
    # (the engine's, in the same worker) tokenize with; changed in place, it added BOS to every prompt there.
    build_byte_tokenizer().save_pretrained(folder)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    tokenizer.chat_template = RICH_TEMPLATE
    tokenizer.save_pretrained(folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["image_token"] = "<|image|>"
    config_path.write_text(json.dumps(config))


def ids_of_texts(tokenizer) -> list[list[int]]:
    return [list(tokenizer(text, add_special_tokens=special)["input_ids"]) for text in TEXTS for special in (True, False)]


def ids_of_chats(tokenizer) -> list[list[int]]:
    found = []
    for chat in CHATS:
        conversation = [{"role": role, "content": content} for role, content in chat]
        for add_generation_prompt in (True, False):
            encoded = tokenizer.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt,
                                                    tokenize=True, return_dict=True)
            found.append(list(encoded["input_ids"]))
    return found


def assert_tokenizes_as_auto_tokenizer(folder) -> None:
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    loaded = load_tokenizer(str(folder))
    assert isinstance(loaded, FileTokenizer), "a folder with tokenizer.json loads without transformers"
    assert ids_of_texts(loaded) == ids_of_texts(reference)
    assert ids_of_chats(loaded) == ids_of_chats(reference)
    for chat in CHATS:  # the rendered text too, so a difference reads as text
        conversation = [{"role": role, "content": content} for role, content in chat]
        assert loaded.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False) == \
            reference.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)


def test_an_explicit_tokenizer_wins_and_other_names_pass_through(tmp_path):
    assert tokenizer_source(catalogue.DEFAULT_MODEL, override="/srv/tokenizer") == "/srv/tokenizer"
    assert tokenizer_source(str(tmp_path)) == str(tmp_path)


def test_a_catalogue_model_is_its_converted_folder_when_prepared(tmp_path, monkeypatch):
    monkeypatch.setenv("KVBOOST_MODEL_DIR", str(tmp_path))
    with pytest.raises(TokenizerNotFound, match="make model MODEL=SmolLM2-135M-Instruct"):
        tokenizer_source("HuggingFaceTB/SmolLM2-135M-Instruct")
    folder = tmp_path / catalogue.DEFAULT_MODEL
    folder.mkdir()
    (folder / ".kvboost-converted").write_text('{"sha256": "x"}')
    assert tokenizer_source("smollm2-135m") == str(folder)


def test_the_loaded_tokenizer_tokenizes_every_probe_as_the_original(tmp_path):
    original = build_byte_tokenizer()
    original.save_pretrained(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    assert [ids for _, _, ids in tokenize_probes(loaded)] == [ids for _, _, ids in tokenize_probes(original)]


def test_the_test_tokenizer_tokenizes_texts_and_chats_as_auto_tokenizer(tmp_path):
    build_byte_tokenizer().save_pretrained(tmp_path)
    assert_tokenizes_as_auto_tokenizer(tmp_path)


def test_bos_post_processor_config_tokens_and_template_environment_match_auto_tokenizer(tmp_path):
    save_rich_tokenizer(tmp_path)
    assert_tokenizes_as_auto_tokenizer(tmp_path)
    loaded = load_tokenizer(str(tmp_path))
    # The named token only the config declares is a special token here too: one id, not its bytes.
    assert len(loaded("<|image|>", add_special_tokens=False)["input_ids"]) == 1
    with pytest.raises(Exception, match="bad role"):
        loaded.apply_chat_template([{"role": "tool", "content": "x"}], tokenize=False)


def save_llama_class_tokenizer(folder) -> None:
    """A model-specific class (LlamaTokenizer: Metaspace pieces, byte fallback, BOS from its post-processor) over a tiny
    vocabulary, with the rich template: AutoTokenizer rebuilds this class from the saved files."""
    import string

    from transformers import LlamaTokenizer

    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for symbol in ["▁", *string.ascii_letters, *string.digits, *string.punctuation, " ", "\n", "\t"]:
        vocab.setdefault(symbol, len(vocab))
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    merges = [("▁", "t"), ("▁t", "h"), ("e", "r")]
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = LlamaTokenizer(vocab=vocab, merges=merges)
    tokenizer.chat_template = RICH_TEMPLATE
    tokenizer.save_pretrained(folder)


def test_a_model_specific_tokenizer_class_tokenizes_as_auto_tokenizer(tmp_path):
    save_llama_class_tokenizer(tmp_path)
    assert json.loads((tmp_path / "tokenizer_config.json").read_text())["tokenizer_class"] == "LlamaTokenizer"
    assert_tokenizes_as_auto_tokenizer(tmp_path)


def test_a_config_option_that_rewrites_the_backend_loads_through_transformers(tmp_path):
    build_byte_tokenizer().save_pretrained(tmp_path)
    config_path = tmp_path / "tokenizer_config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "split_special_tokens": True}))
    loaded = load_tokenizer(str(tmp_path))
    assert not isinstance(loaded, FileTokenizer)
    assert len(loaded("<|im_end|>", add_special_tokens=False)["input_ids"]) > 1  # split, as transformers does


def test_a_tokenizer_without_a_default_chat_template_says_so(tmp_path):
    tokenizer = build_byte_tokenizer()
    tokenizer.save_pretrained(tmp_path)
    (tmp_path / "chat_template.jinja").unlink()
    with pytest.raises(ValueError, match="no default chat template"):
        load_tokenizer(str(tmp_path)).apply_chat_template([{"role": "user", "content": "x"}])


def test_loading_and_using_a_tokenizer_loads_neither_transformers_nor_torch(tmp_path):
    save_rich_tokenizer(tmp_path)
    probe = (f"import sys\nfrom router.tokenizer import load_tokenizer\ntokenizer = load_tokenizer({str(tmp_path)!r})\n"
             "tokenizer('x')\ntokenizer.apply_chat_template([{'role': 'user', 'content': 'x'}])\n"
             "print(sorted({name.split('.')[0] for name in sys.modules} & {'torch', 'transformers'}))\n")
    loaded = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip() == "[]"


@pytest.mark.slow
def test_smollm2_tokenizes_texts_and_chats_as_auto_tokenizer():
    from inference_service.model.weights import prepare_default_model

    assert_tokenizes_as_auto_tokenizer(prepare_default_model())
