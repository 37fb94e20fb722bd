"""Offline demo assets: digits dataset, tiny tokenizer, tiny checkpoints that load like real."""

from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from transformers import (
    AutoTokenizer,
    Qwen3_5ForConditionalGeneration,
    Qwen3_5MoeForConditionalGeneration,
)
from transformers.models.qwen3_5.tokenization_qwen3_5 import Qwen3_5Tokenizer

from vlmcp.data.dataset import load_samples
from vlmcp.data.pack import pack_samples
from vlmcp.demo.assets import DIGIT_QUESTION, write_digits_dataset
from vlmcp.model.tiny import SPECIAL_TOKENS, TINY_SPECIAL_IDS, tiny_qwen3_5_config


@pytest.mark.parametrize(("fixture", "model_class"), [
    ("tiny_checkpoint", Qwen3_5ForConditionalGeneration),
    ("tiny_moe_checkpoint", Qwen3_5MoeForConditionalGeneration),
])
def test_tiny_checkpoint_round_trips_through_from_pretrained(fixture, model_class, request):
    checkpoint = request.getfixturevalue(fixture)
    names = {p.name for p in checkpoint.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "preprocessor_config.json"} <= names
    model = model_class.from_pretrained(checkpoint)
    loaded = model.state_dict()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        built = model_class(tiny_qwen3_5_config(moe=fixture == "tiny_moe_checkpoint")).state_dict()
    assert set(loaded) == set(built)
    assert all(torch.equal(loaded[k], built[k]) for k in built)
    for key, value in TINY_SPECIAL_IDS.items():
        assert getattr(model.config, key) == value


def test_tiny_tokenizer_places_specials_at_the_tiny_config_ids(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    assert isinstance(tokenizer, Qwen3_5Tokenizer)
    assert {tokenizer.convert_tokens_to_ids(t): t for t in SPECIAL_TOKENS.values()} == \
        SPECIAL_TOKENS
    config = json.loads((tiny_checkpoint / "config.json").read_text())
    assert tokenizer.eos_token == "<|im_end|>"
    assert tokenizer.eos_token_id == config["text_config"]["eos_token_id"] == 2
    assert tokenizer.pad_token_id == 0
    assert len(tokenizer) <= config["text_config"]["vocab_size"] == 512
    assert tokenizer.decode(tokenizer("What digit is this? 7")["input_ids"]) == \
        "What digit is this? 7"


def test_tiny_chat_template_renders_string_and_typed_content_alike(tiny_checkpoint):
    tokenizer = AutoTokenizer.from_pretrained(tiny_checkpoint)
    typed = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Hi"}]}]
    text = tokenizer.apply_chat_template(typed, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>Hi<|im_end|>\n"
                    "<|im_start|>assistant\n")
    plain = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "7"}]
    assert tokenizer.apply_chat_template(plain, tokenize=False) == \
        "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n7<|im_end|>\n"


def test_digits_dataset_is_held_out_and_one_image_token_per_sample(digits_jsonl, tiny_processor):
    train = [json.loads(line) for line in (digits_jsonl / "train.jsonl").read_text().splitlines()]
    held = [json.loads(line) for line in (digits_jsonl / "eval.jsonl").read_text().splitlines()]
    assert (len(train), len(held)) == (64, 16)
    assert not {r["images"][0] for r in train} & {r["images"][0] for r in held}
    first = train[0]
    assert first["messages"][0]["content"] == f"<image>{DIGIT_QUESTION}"
    assert first["messages"][1]["content"] in [str(d) for d in range(10)]
    with Image.open(digits_jsonl / first["images"][0]) as image:
        assert image.size == (32, 32)
    samples = load_samples(digits_jsonl / "eval.jsonl", tiny_processor, max_seq_len=64)
    assert all(s.image_grid_thw.tolist() == [[1, 2, 2]] for s in samples)
    assert all(s.mm_token_type_ids.sum() == 1 for s in samples)


def test_digits_dataset_is_deterministic_for_a_seed(tmp_path):
    a = write_digits_dataset(tmp_path / "a", n_train=8, n_eval=4, seed=3)
    b = write_digits_dataset(tmp_path / "b", n_train=8, n_eval=4, seed=3)
    assert [p.read_text() for p in a] == [p.read_text() for p in b]
    with pytest.raises(ValueError, match="exceeds"):
        write_digits_dataset(tmp_path / "c", n_train=1800, n_eval=1)


def test_tiny_checkpoint_computes_a_loss_on_a_packed_digits_batch(tiny_checkpoint, digits_jsonl,
                                                                 tiny_processor):
    model = Qwen3_5ForConditionalGeneration.from_pretrained(tiny_checkpoint).eval()
    samples = load_samples(digits_jsonl / "train.jsonl", tiny_processor, max_seq_len=64)[:1]
    (batch,) = pack_samples(samples, max_seq_len=64)
    with torch.no_grad():
        out = model(input_ids=batch.input_ids[None], position_ids=batch.position_ids[:, None],
                    mm_token_type_ids=batch.mm_token_type_ids[None],
                    pixel_values=batch.pixel_values, image_grid_thw=batch.image_grid_thw,
                    use_cache=False)
    loss = torch.nn.functional.cross_entropy(out.logits[0], batch.targets, ignore_index=-100)
    assert torch.isfinite(loss) and abs(loss.item() - torch.log(torch.tensor(512.0)).item()) < 1.0
