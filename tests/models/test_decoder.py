"""The shared decoder LLM: tokenizer, training, cache, resume, generation, attention, errors.

Everything runs on the ``llama_fedfm_micro`` variant (2 layers of width 32, 320 tokens, context
32) trained for a few steps on the docstrings of the standard library's ``importlib`` package (a
fifth of a second to parse), one torch thread, in pytest's temporary folders.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from huggingface_hub import constants as hub_constants
from transformers import AttentionInterface, AutoTokenizer, GPT2Config, GPT2LMHeadModel
from transformers.masking_utils import AttentionMaskInterface
from transformers.models.gpt2.modeling_gpt2 import eager_attention_forward as gpt2_eager_attention
from transformers.models.llama.modeling_llama import eager_attention_forward

from fedfm.cli import build_parser, decoder_source, main
from fedfm.data.stdlib_text import stdlib_documents, stdlib_root
from fedfm.errors import CheckpointError, ConfigError, ModelError
from fedfm.models.decoder import (
    DecoderSource,
    DecoderTraining,
    check_vocabulary,
    context_length,
    encode_prompt,
    greedy_generate,
    load_causal_lm,
    load_decoder,
    register_attention,
    train_bpe,
    train_decoder,
)
from fedfm.models.decoder.artefact import REPORT_FILE

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MICRO = "llama_fedfm_micro"
TEXT_ROOT = stdlib_root() / "importlib"
TRAINING = DecoderTraining(
    steps=16, batch_size=8, lr=1e-2, warmup_steps=2, eval_every=4, checkpoint_every=2
)


def _source(cache_dir: Path, **changes: Any) -> DecoderSource:
    return DecoderSource(
        name=MICRO, cache_dir=cache_dir, training=replace(TRAINING, **changes), text_root=TEXT_ROOT
    )


def _weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in model.state_dict().items()}


def _same_weights(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory, one_torch_thread: None) -> DecoderSource:
    """One micro decoder trained for the module, uninterrupted."""
    source = _source(tmp_path_factory.mktemp("decoder-cache"))
    train_decoder(source, progress=False, log=lambda _: None)
    return source


@pytest.fixture(scope="module")
def micro(trained: DecoderSource) -> tuple[Any, Any]:
    return load_decoder(trained)


@pytest.fixture()
def attention_names() -> Iterator[list[str]]:
    """Names a test registers; removed afterwards (transformers' registries are global)."""
    names: list[str] = []
    yield names
    for name in names:
        AttentionInterface._global_mapping.pop(name, None)
        AttentionMaskInterface._global_mapping.pop(name, None)


def test_tokenizer_round_trips_real_docstrings_it_was_not_trained_on() -> None:
    documents = stdlib_documents(TEXT_ROOT)
    train, unseen = documents[: len(documents) // 2], documents[len(documents) // 2 :]
    tokenizer = train_bpe([d.text for d in train], vocab_size=400, context=64)
    assert len(tokenizer) == 400
    texts = [d.text for d in unseen] + ["naïve café: 東京 \t tabs\n\n  indented ✓"]
    for text in texts:
        ids = tokenizer(text, verbose=False)["input_ids"]
        assert ids[0] == tokenizer.bos_token_id
        assert tokenizer.decode(ids, skip_special_tokens=True) == text
    # merges learned from docstrings: fewer tokens than bytes
    sample = unseen[0].text
    assert len(tokenizer(sample)["input_ids"]) < 0.7 * len(sample.encode())


def test_saved_tokenizer_loads_back_identical(tmp_path: Path, micro: tuple[Any, Any]) -> None:
    _, tokenizer = micro  # as load_decoder gives it: AutoTokenizer on the cached folder
    tokenizer.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    text = stdlib_documents(TEXT_ROOT)[-1].text + " ✓"
    ids = tokenizer(text, verbose=False)["input_ids"]
    assert again(text, verbose=False)["input_ids"] == ids
    assert again.decode(ids, skip_special_tokens=True) == text
    assert (again.bos_token_id, again.eos_token_id, again.pad_token_id) == (0, 1, 2)


def test_training_lowers_the_loss(trained: DecoderSource) -> None:
    report = json.loads((trained.path / REPORT_FILE).read_text())
    history = report["history"]
    assert [row["step"] for row in history] == [4, 8, 12, 16]
    held_out = [row["held_out_loss_first_blocks"] for row in history]
    assert held_out == sorted(held_out, reverse=True) and held_out[-1] < held_out[0] - 0.3
    assert history[-1]["train_loss"] < history[0]["train_loss"]
    # 16 steps of the micro model reach about the unigram baseline; the default model's margin
    # over it is measured by `fedfm train-llm` (README)
    assert report["held_out_perplexity"] < 1.2 * report["unigram_perplexity"]
    assert report["model"]["class"] == "LlamaForCausalLM"
    assert len(report["samples"]) == 3 and all(s["completion"] for s in report["samples"])
    assert not trained.work_path.exists()  # training state removed once the decoder is saved


def test_cache_hit_returns_identical_weights_without_training(
    trained: DecoderSource, micro: tuple[Any, Any]
) -> None:
    lines: list[str] = []
    report = train_decoder(trained, progress=False, log=lines.append)
    assert lines == [f"[fedfm] decoder: cached at {trained.path}"]
    assert report["held_out_perplexity"] > 1
    again, _ = load_decoder(trained)
    assert _same_weights(_weights(again), _weights(micro[0]))
    # the settings are the key: other training settings are another (absent) decoder
    with pytest.raises(ConfigError, match="fedfm train-llm"):
        load_decoder(_source(trained.cache_dir, seed=1))


def test_interrupted_training_resumes_to_the_same_weights(
    tmp_path: Path, trained: DecoderSource, micro: tuple[Any, Any]
) -> None:
    source = _source(tmp_path)
    assert source.path.name == trained.path.name  # same settings, same key

    def interrupt(step: int) -> None:
        if step == 7:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_decoder(source, progress=False, log=lambda _: None, on_step=interrupt)
    assert not source.path.exists() and (source.work_path / "state.pt").exists()
    lines: list[str] = []
    train_decoder(source, progress=False, log=lines.append)
    assert any("resuming" in line and "after step 6/16" in line for line in lines)
    model, _ = load_decoder(source)
    assert _same_weights(_weights(model), _weights(micro[0]))


def test_restart_discards_saved_state(tmp_path: Path) -> None:
    source = _source(tmp_path, steps=4, warmup_steps=1)

    def interrupt(step: int) -> None:
        if step == 2:  # just saved
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        train_decoder(source, progress=False, log=lambda _: None, on_step=interrupt)
    assert (source.work_path / "state.pt").exists()
    lines: list[str] = []
    train_decoder(source, restart=True, progress=False, log=lines.append)
    assert f"[fedfm] decoder: discarded {source.work_path}" in lines
    assert not any("resuming" in line for line in lines)
    assert source.path.exists()


def test_greedy_generation_is_deterministic_and_equals_argmax_without_cache(
    micro: tuple[Any, Any],
) -> None:
    model, tokenizer = micro
    first = greedy_generate(model, tokenizer, "Return the", max_new_tokens=12)
    assert first == greedy_generate(model, tokenizer, "Return the", max_new_tokens=12)
    ids = tokenizer("Return the", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        for token in first:  # every token is the argmax of a full forward pass (no KV cache)
            predicted = int(model(input_ids=ids).logits[0, -1].argmax())
            assert predicted == token
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)


def test_registered_attention_wrapping_eager_gives_identical_logits(
    trained: DecoderSource, micro: tuple[Any, Any], attention_names: list[str]
) -> None:
    model, tokenizer = micro
    ids = tokenizer("Import a module by name and return it.", return_tensors="pt")["input_ids"]
    calls: list[bool] = []

    def wrapped(module: torch.nn.Module, query: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        calls.append(True)
        return eager_attention_forward(module, query, *args, **kwargs)

    # transformers builds no causal mask for a name it does not know: attention alone leaks the
    # future, which is why register_attention registers the mask beside it
    attention_names += ["fedfm_test_unmasked", "fedfm_test_wrapped"]
    AttentionInterface.register("fedfm_test_unmasked", wrapped)
    register_attention("fedfm_test_wrapped", wrapped)
    with torch.no_grad():
        reference = model(input_ids=ids).logits
        unmasked, _ = load_decoder(trained, attn_implementation="fedfm_test_unmasked")
        assert not torch.allclose(unmasked(input_ids=ids).logits, reference, atol=1e-3)
        swapped, _ = load_decoder(trained, attn_implementation="fedfm_test_wrapped")
        calls.clear()
        assert torch.equal(swapped(input_ids=ids).logits, reference)
    assert len(calls) == 2  # one call per layer
    assert greedy_generate(swapped, tokenizer, "Return the", max_new_tokens=8) == greedy_generate(
        model, tokenizer, "Return the", max_new_tokens=8
    )


def test_any_local_hugging_face_causal_lm_loads_the_same_way(
    tmp_path: Path, micro: tuple[Any, Any], attention_names: list[str]
) -> None:
    _, tokenizer = micro
    config = GPT2Config(
        vocab_size=len(tokenizer), n_positions=24, n_embd=16, n_layer=1, n_head=2,
        bos_token_id=0, eos_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    GPT2LMHeadModel(config).save_pretrained(str(tmp_path))
    tokenizer.save_pretrained(str(tmp_path))
    model, loaded = load_decoder(tmp_path)
    assert type(model).__name__ == "GPT2LMHeadModel" and context_length(model) == 24
    attention_names.append("fedfm_test_gpt2")
    register_attention("fedfm_test_gpt2", gpt2_eager_attention)
    swapped, _ = load_causal_lm(tmp_path, attn_implementation="fedfm_test_gpt2")
    ids = loaded("Return the", return_tensors="pt")["input_ids"]
    with torch.no_grad():
        assert torch.equal(swapped(input_ids=ids).logits, model(input_ids=ids).logits)
    assert len(greedy_generate(model, loaded, "Return the", max_new_tokens=5)) == 5


def test_missing_decoder_is_refused_with_the_command_that_makes_it(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as error:
        load_decoder(cache_dir=tmp_path / "empty")
    assert f"fedfm train-llm --cache-dir {tmp_path / 'empty'}" in str(error.value)


def test_unknown_model_offline_is_one_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)
    with pytest.raises(ModelError, match=r"'fedfm-tests/no-such-model' is not in the Hugging Face"):
        load_decoder("fedfm-tests/no-such-model")
    with pytest.raises(ModelError, match="no model folder"):
        load_causal_lm("./no/such/folder")
    with pytest.raises(ModelError, match="is a file"):
        load_decoder(__file__)
    with pytest.raises(ModelError, match="not registered"):
        load_decoder(attn_implementation="fedfm_never_registered")


def test_tokenizer_of_another_model_is_refused(
    tmp_path: Path, trained: DecoderSource, micro: tuple[Any, Any]
) -> None:
    model, _ = micro
    larger = train_bpe([d.text for d in stdlib_documents(TEXT_ROOT)], vocab_size=400, context=32)
    with pytest.raises(ModelError, match="400 tokens but the model embeds only 320"):
        check_vocabulary(model, larger)
    folder = tmp_path / "mixed"
    shutil.copytree(trained.path, folder)
    larger.save_pretrained(str(folder))  # a folder whose tokenizer belongs to another model
    with pytest.raises(ModelError, match="belongs to another model"):
        load_causal_lm(folder)
    report = json.loads((folder / REPORT_FILE).read_text())
    (folder / REPORT_FILE).write_text(json.dumps({**report, "format": "fedfm-decoder/0"}))
    with pytest.raises(CheckpointError, match="expected 'fedfm-decoder/1'"):
        load_causal_lm(folder)


def test_text_longer_than_the_context_is_refused(micro: tuple[Any, Any]) -> None:
    model, tokenizer = micro
    context = context_length(model)
    assert context == 32
    with pytest.raises(ConfigError, match="more than the model's context of 32"):
        encode_prompt(tokenizer, "word " * 40, context=context)
    prompt = "Return the"
    room = context - len(tokenizer(prompt)["input_ids"])
    assert len(greedy_generate(model, tokenizer, prompt, max_new_tokens=room)) <= room
    with pytest.raises(ConfigError, match="tokens to generate"):
        greedy_generate(model, tokenizer, prompt, max_new_tokens=room + 1)


def test_train_llm_command_prints_the_cache_and_perplexity(
    trained: DecoderSource, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    words = ["train-llm", "--model", MICRO, "--cache-dir", str(trained.cache_dir)]
    for key in ("steps", "batch_size", "lr", "warmup_steps"):
        words += [f"--{key.replace('_', '-')}", str(getattr(TRAINING, key))]
    words += ["--text-root", str(TEXT_ROOT), "--results-dir", str(tmp_path), "--no-progress"]
    assert main(words) == 0  # the fixture's decoder: a cache hit
    out = capsys.readouterr().out
    assert str(trained.path) in out and "held-out perplexity" in out
    results = json.loads((tmp_path / f"decoder_{MICRO}.json").read_text())
    report = json.loads((trained.path / REPORT_FILE).read_text())
    assert results["rows"][0]["held_out_perplexity"] == report["held_out_perplexity"]
    assert main(["train-llm", "--steps", "0", "--no-progress"]) == 2  # one-line error
    assert "steps must be >= 1" in capsys.readouterr().err


def test_train_llm_defaults_make_what_load_decoder_loads() -> None:
    args = build_parser().parse_args(["train-llm"])
    assert decoder_source(args) == DecoderSource()
    assert decoder_source(args).path == DecoderSource().path


def test_every_public_name_loads() -> None:
    import fedfm.models.decoder as decoder

    assert sorted(decoder.__all__) == sorted(decoder._HOME)
    assert all(callable(getattr(decoder, name)) or name.isupper() for name in decoder.__all__)
